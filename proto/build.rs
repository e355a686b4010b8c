//! Compiles `proto/gpulse/v1/*.proto` and Prometheus's remote protocol
//! (`proto/prometheus/*.proto`) with protox (pure Rust, no `protoc` install).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/gpulse/v1/ingest.proto",
        "proto/prometheus/remote.proto",
        "proto/prometheus/types.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
