use super::*;
use gpulse_proto::v1::Label;

fn def(id: u32) -> SeriesDef {
    SeriesDef {
        id,
        metric: format!("m{id}"),
        labels: vec![Label {
            name: "gpu".into(),
            value: id.to_string(),
        }],
    }
}

fn defs() -> Vec<SeriesDef> {
    (0..4).map(def).collect()
}

/// Batch `k`: series 0..3, timestamp 1000 k, values k + i / 4.
fn batch(k: u64) -> Pending {
    Pending {
        epoch: 42,
        ids: vec![0, 1, 2, 3],
        ts_ms: vec![1000 * k as i64; 4],
        values: (0..4).map(|i| k as f64 + i as f64 / 4.0).collect(),
    }
}

/// Interns into a table that puts series at 10 + the series' original id,
/// so that a test sees ids really remapped on reload.
fn shifted(d: &SeriesDef) -> u32 {
    d.metric[1..].parse::<u32>().unwrap() + 10
}

fn open(dir: &Path, max: u64, file: u64) -> Opened {
    Spool::open(dir, max, file, shifted).unwrap()
}

#[test]
fn batches_come_back_after_a_restart_with_remapped_ids() {
    let dir = tempfile::tempdir().unwrap();
    let Opened {
        mut spool,
        epoch,
        next_seq,
    } = open(dir.path(), 1 << 20, 1 << 20);
    assert_eq!(next_seq, 1);
    assert_ne!(epoch, 0);
    for seq in 1..=3 {
        assert_eq!(
            spool.append(seq, &batch(seq), &defs()).unwrap(),
            Dropped::default()
        );
    }
    // This run reads its own ids.
    assert_eq!(spool.read(2).unwrap().unwrap(), batch(2));
    assert!(spool.ack(2));
    assert!(!spool.ack(2));
    spool.sync().unwrap();
    drop(spool);

    let again = open(dir.path(), 1 << 20, 1 << 20);
    assert_eq!(again.epoch, epoch, "the epoch survives a restart");
    // The acked batch 2 is not remembered as acked on disk, but the numbering
    // goes on past the reserved block, so no seq is ever used twice.
    assert_eq!(again.next_seq, 1 + SEQ_BLOCK);
    let s = again.spool;
    assert_eq!(s.batches(), 3);
    let mut want = batch(3);
    want.ids = vec![10, 11, 12, 13];
    assert_eq!(s.read(3).unwrap().unwrap(), want);
    assert_eq!(s.first_at_or_after(0), Some(1));
}

#[test]
fn a_file_is_deleted_once_all_its_batches_are_acked() {
    let dir = tempfile::tempdir().unwrap();
    // Small files: one or two batches each.
    let mut s = open(dir.path(), 1 << 20, 200).spool;
    for seq in 1..=6 {
        s.append(seq, &batch(seq), &defs()).unwrap();
    }
    let files = || {
        fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .extension()
                    .is_some_and(|x| x == "spool")
            })
            .count()
    };
    let before = files();
    assert!(before >= 3, "{before} files");
    for seq in 1..=6 {
        s.ack(seq);
    }
    // Only the file being written stays.
    assert_eq!(files(), 1);
    assert_eq!(s.batches(), 0);
}

#[test]
fn a_full_spool_drops_its_oldest_file() {
    let dir = tempfile::tempdir().unwrap();
    let one = encode_record(&Batch {
        seq: 1,
        new_series: defs(),
        series_ids: vec![0, 1, 2, 3],
        timestamps_ms: vec![1000; 4],
        values: vec![1.0, 1.25, 1.5, 1.75],
        epoch: 42,
    })
    .len() as u64;
    // Files of one batch each; room for about three files.
    let mut s = open(dir.path(), 3 * (one + HEADER_LEN) + 10, 1).spool;
    let mut dropped = Dropped::default();
    for seq in 1..=10 {
        let d = s.append(seq, &batch(seq), &defs()).unwrap();
        dropped.batches += d.batches;
        dropped.samples += d.samples;
    }
    assert!(s.bytes() <= 3 * (one + HEADER_LEN) + 10);
    assert_eq!(dropped.batches + s.batches() as u64, 10);
    assert_eq!(dropped.samples, 4 * dropped.batches);
    // The newest survive, the oldest went.
    assert!(s.contains(10) && !s.contains(1));
    assert_eq!(s.read(10).unwrap().unwrap(), batch(10));
}

#[test]
fn a_torn_tail_is_cut_and_damage_elsewhere_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20, 1 << 20).spool;
    for seq in 1..=4 {
        s.append(seq, &batch(seq), &defs()).unwrap();
    }
    drop(s);
    let path = dir.path().join(file_name(1));
    let len = fs::metadata(&path).unwrap().len();
    // A crash in the middle of writing batch 4.
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 5)
        .unwrap();
    let s = open(dir.path(), 1 << 20, 1 << 20).spool;
    assert_eq!(s.damaged, 0);
    assert_eq!(s.batches(), 3);
    drop(s);

    // A flipped bit in batch 2: batch 1 stays, 2 and 3 are lost and counted.
    let mut buf = fs::read(&path).unwrap();
    let (_, l1) = decode_record(&buf[HEADER_LEN as usize..]).unwrap();
    buf[HEADER_LEN as usize + l1 + FRAME_LEN + 3] ^= 0x40;
    fs::write(&path, &buf).unwrap();
    // Another file written later makes this one not the newest.
    let mut s = open(dir.path(), 1 << 20, 1).spool;
    assert_eq!(s.damaged, 1);
    assert_eq!(s.batches(), 1);
    s.append(9, &batch(9), &defs()).unwrap();
    drop(s);
    let s = open(dir.path(), 1 << 20, 1).spool;
    assert_eq!(s.damaged, 1);
    let mut want = batch(1);
    want.ids = vec![10, 11, 12, 13];
    assert_eq!(s.read(1).unwrap().unwrap(), want);
    assert!(s.contains(9));
}

#[test]
fn every_truncation_and_flip_of_a_record_is_an_error() {
    let rec = encode_record(&Batch {
        seq: 7,
        new_series: vec![def(0)],
        series_ids: vec![0],
        timestamps_ms: vec![5],
        values: vec![0.5],
        epoch: 1,
    });
    assert_eq!(decode_record(&rec).unwrap().1, rec.len());
    for cut in 0..rec.len() {
        assert!(decode_record(&rec[..cut]).is_err(), "cut {cut}");
    }
    for i in 0..rec.len() {
        let mut b = rec.clone();
        b[i] ^= 0x10;
        assert!(decode_record(&b).is_err(), "flip in byte {i}");
    }
}

#[test]
fn a_spool_is_used_by_one_agent_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let _first = open(dir.path(), 1 << 20, 1 << 20);
    let err = Spool::open(dir.path(), 1 << 20, 1 << 20, shifted).unwrap_err();
    assert!(err.to_string().contains("in use"), "{err}");
}

/// Issue #14: a disk that runs full in the middle of a record (a short
/// write, then `ENOSPC`) must not leave a torn record in front of later
/// ones. For every budget from 0 bytes to past a whole file (header and
/// record), with one file for everything and with a file per batch (so the
/// header write fails too), the disk fills during batches 4 and 7 and frees
/// again; then the agent "dies" (no sync, no close) and a new run opens the
/// spool. Every batch the spool said it stored reads back, in this run and
/// the next, and no other.
#[test]
fn issue_14_enospc_mid_record_loses_no_stored_batch() {
    let one = encode_record(&Batch {
        seq: 4,
        new_series: defs(),
        series_ids: vec![0, 1, 2, 3],
        timestamps_ms: vec![4000; 4],
        values: vec![4.0, 4.25, 4.5, 4.75],
        epoch: 42,
    })
    .len() as u64;
    let one_plain = encode_record(&Batch {
        seq: 4,
        new_series: Vec::new(),
        series_ids: vec![0, 1, 2, 3],
        timestamps_ms: vec![4000; 4],
        values: vec![4.0, 4.25, 4.5, 4.75],
        epoch: 42,
    })
    .len() as u64;
    for file_bytes in [1 << 20, 1] {
        for budget in 0..one + HEADER_LEN + 2 {
            let ctx = format!("file_bytes {file_bytes}, budget {budget}");
            let dir = tempfile::tempdir().unwrap();
            let fault = std::sync::Arc::new(fileio::Fault::default());
            let mut s = open(dir.path(), 1 << 20, file_bytes).spool;
            s.io.fault = Some(fault.clone());
            let mut stored = Vec::new();
            for seq in 1..=9 {
                if seq == 4 || seq == 7 {
                    fault.fill_after(budget);
                }
                match s.append(seq, &batch(seq), &defs()) {
                    Ok(d) => {
                        assert_eq!(d, Dropped::default(), "{ctx}");
                        stored.push(seq);
                    }
                    Err(e) => assert_eq!(e.kind(), io::ErrorKind::StorageFull, "{ctx}: {e}"),
                }
                // Space comes back (an operator deleted something).
                fault.free();
            }
            // A batch of a new file defines its series; later ones in the same file do not.
            let whole = if file_bytes == 1 {
                one + HEADER_LEN
            } else {
                one_plain
            };
            let want: Vec<u64> = if budget >= whole {
                (1..=9).collect()
            } else {
                vec![1, 2, 3, 5, 6, 8, 9]
            };
            assert_eq!(stored, want, "{ctx}");
            for &seq in &stored {
                assert_eq!(
                    s.read(seq).unwrap().unwrap(),
                    batch(seq),
                    "{ctx}: seq {seq}"
                );
            }
            drop(s);

            let s = open(dir.path(), 1 << 20, file_bytes).spool;
            assert_eq!(s.damaged, 0, "{ctx}");
            assert_eq!(s.batches(), stored.len(), "{ctx}");
            for seq in 1..=9 {
                assert_eq!(s.contains(seq), stored.contains(&seq), "{ctx}: seq {seq}");
            }
            for &seq in &stored {
                let mut w = batch(seq);
                w.ids = vec![10, 11, 12, 13];
                assert_eq!(
                    s.read(seq).unwrap().unwrap(),
                    w,
                    "{ctx}: seq {seq} after reopen"
                );
            }
        }
    }
}

/// When the cut-back of a failed write fails too, the spool leaves that file
/// and starts a new one with the next batch: the stored batches still read
/// back, now and after a restart (the abandoned file's torn tail is then
/// counted as damage, behind every batch it stored).
#[test]
fn issue_14_failed_cut_back_starts_a_new_file() {
    let dir = tempfile::tempdir().unwrap();
    let fault = std::sync::Arc::new(fileio::Fault::default());
    let mut s = open(dir.path(), 1 << 20, 1 << 20).spool;
    s.io.fault = Some(fault.clone());
    for seq in 1..=2 {
        s.append(seq, &batch(seq), &defs()).unwrap();
    }
    fault.fill_after(7);
    fault.set_len_fails(true);
    assert!(s.append(3, &batch(3), &defs()).is_err());
    fault.free();
    fault.set_len_fails(false);
    for seq in 4..=5 {
        s.append(seq, &batch(seq), &defs()).unwrap();
    }
    for seq in [1, 2, 4, 5] {
        assert_eq!(s.read(seq).unwrap().unwrap(), batch(seq));
    }
    assert!(dir.path().join(file_name(2)).exists());
    drop(s);
    let s = open(dir.path(), 1 << 20, 1 << 20).spool;
    assert_eq!(s.batches(), 4);
    assert_eq!(s.damaged, 1, "the torn tail of the abandoned file");
    assert!(!s.contains(3));
    for seq in [1, 2, 4, 5] {
        let mut w = batch(seq);
        w.ids = vec![10, 11, 12, 13];
        assert_eq!(s.read(seq).unwrap().unwrap(), w);
    }
}
