//! Golden files of the on-disk formats, kept in `fuzz/seeds/` where they
//! also seed the fuzz targets that open files of that format.

use std::path::Path;

/// Checks that `bytes`, freshly encoded, equal the committed golden file
/// `fuzz/seeds/<target>/<name>`, and returns the committed bytes. With
/// `GPULSE_BLESS=1` the file is rewritten first: do that only after a
/// deliberate format change (a new version).
pub(crate) fn check(target: &str, name: &str, bytes: &[u8]) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/seeds")
        .join(target)
        .join(name);
    if std::env::var_os("GPULSE_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, bytes).unwrap();
    }
    let committed = std::fs::read(&path).unwrap();
    assert!(
        committed == bytes,
        "the encoding of {name} changed ({} bytes, was {}); bless it with GPULSE_BLESS=1 if intended",
        bytes.len(),
        committed.len()
    );
    committed
}
