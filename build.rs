//! Compiles the web UI's files (`ui/`, served at `/` and `/ui/…` by
//! `src/fleet.rs`) into the binary: generates `ui_files.rs`, a table of
//! (path below `ui/`, bytes) for every file there. Also packs the binaries'
//! relative relocations on Linux.

use std::path::{Path, PathBuf};

fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            walk(root, &path, out);
        } else if let Ok(rel) = path.strip_prefix(root) {
            let rel = rel.to_string_lossy().replace('\\', "/");
            out.push((rel, path));
        }
    }
}

fn main() {
    // Relative relocations packed (DT_RELR, glibc 2.36 and binutils 2.38 or
    // newer): a position-independent binary of this size carries about
    // 13 MB of them unpacked (docs/BENCHMARKS.md, "Build times").
    let target = std::env::var("TARGET").unwrap_or_default();
    if target.ends_with("-linux-gnu") {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest.join("ui");
    // A folder: cargo looks at every file below it.
    println!("cargo:rerun-if-changed=ui");
    let mut files = Vec::new();
    walk(&root, &root, &mut files);
    files.sort();
    let mut code = String::from("pub(crate) static FILES: &[(&str, &[u8])] = &[\n");
    for (rel, path) in files {
        code += &format!(
            "    ({rel:?}, include_bytes!({:?})),\n",
            path.display().to_string()
        );
    }
    code += "];\n";
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo")).join("ui_files.rs");
    std::fs::write(out, code).expect("writing ui_files.rs into OUT_DIR");
}
