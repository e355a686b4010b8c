//! Encodes the real recordings' columns (`shared/data/real`, read in place)
//! in 4096-sample chunks, then decodes them once: a fixed workload for
//! counting instructions, which do not move with the machine's load.
//!
//! ```sh
//! cargo build --profile bench -p storage --example column_codec
//! valgrind --tool=callgrind --toggle-collect='*decode_values*' \
//!     target/release/examples/column_codec values
//! ```
//!
//! The argument picks what is decoded: `values`, `ts`, or both (none).

// An example reports to stdout.
#![allow(clippy::print_stdout)]

use storage::column::{decode_ts, decode_values};

// The recordings' loader, shared with the benches.
#[allow(dead_code)]
#[path = "../benches/fleet/mod.rs"]
mod fleet;

fn main() {
    let Some(series) = fleet::real_series() else {
        eprintln!("shared/data/real is absent");
        std::process::exit(2);
    };
    let columns = fleet::column_chunks(&series);
    let what = std::env::args().nth(1).unwrap_or_default();
    let (mut ts, mut vals) = (Vec::new(), Vec::new());
    let (mut samples, mut sum) = (0usize, 0.0);
    for (tb, vb, n) in &columns {
        ts.clear();
        vals.clear();
        if what != "values" {
            decode_ts(tb, *n, &mut ts).expect("timestamps decode");
        }
        if what != "ts" {
            decode_values(vb, *n, &mut vals).expect("values decode");
        }
        samples += n;
        sum += vals.iter().sum::<f64>();
    }
    let bytes: usize = columns.iter().map(|(_, vb, _)| vb.len()).sum();
    println!("{samples} samples, sum {sum}, value blocks {bytes} bytes");
}
