use super::*;

fn ev<'a>(seq: u64, id: &'a str, raw: &'a str) -> FrameEvent<'a> {
    FrameEvent {
        seq,
        id,
        partition: "c:conv",
        raw,
    }
}

fn frames(records: &[(&str, Millis, &[FrameEvent<'_>])]) -> Frames {
    let mut f = Frames::default();
    for (d, t, e) in records {
        f.push(d, *t, e);
    }
    f
}

fn all(dir: &Path) -> (Vec<(LogPosition, LogRecord)>, ScanEnd) {
    let mut out = Vec::new();
    let end = scan(dir, LogPosition::default(), |at, record, _| {
        out.push((at, record));
        ControlFlow::Continue(())
    })
    .expect("scan");
    (out, end)
}

#[test]
fn committed_frames_read_back_at_their_locations_in_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, torn) = Appender::open(dir.path(), SEGMENT_BYTES).expect("open");
    assert!(!torn);
    let at = log.queue(frames(&[
        (
            "d1",
            5,
            &[ev(1, "e1", r#"{"id":"e1"}"#), ev(2, "e2", r#"{"id":"e2"}"#)],
        ),
        ("d2", 6, &[ev(3, "e3", r#"{"id":"e3"}"#)]),
    ]));
    log.commit().expect("commit");
    assert_eq!(at.len(), 2);
    let second = read_at(dir.path(), at[1]).expect("read").expect("frame");
    assert_eq!(
        (
            second.delivery.as_str(),
            second.received_at,
            second.seqs.clone()
        ),
        ("d2", 6, vec![3])
    );
    let first = read_at(dir.path(), at[0]).expect("read").expect("frame");
    assert_eq!(first.position(2), Some(1));
    assert_eq!(first.events[1].get(), r#"{"id":"e2"}"#);
    assert_eq!(first.ids, vec!["e1", "e2"]);
    assert_eq!(first.partitions, vec!["c:conv", "c:conv"]);

    let (records, end) = all(dir.path());
    let delivered: Vec<_> = records.iter().map(|(_, r)| r.delivery.as_str()).collect();
    assert_eq!(delivered, vec!["d1", "d2"]);
    assert_eq!(records[1].0, at[1]);
    assert_eq!(
        end.next,
        log.end(),
        "the scan ends where appending continues"
    );
    assert!(!end.torn_tail);
}

#[test]
fn a_torn_tail_is_cut_on_open_and_appending_continues_after_the_intact_frames() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, _) = Appender::open(dir.path(), SEGMENT_BYTES).expect("open");
    log.queue(frames(&[("d1", 1, &[ev(1, "e1", r#"{"id":"e1"}"#)])]));
    log.commit().expect("commit");
    let intact = log.end();
    log.queue(frames(&[("d2", 2, &[ev(2, "e2", r#"{"id":"e2"}"#)])]));
    log.commit().expect("commit");
    drop(log);
    // A crash in the middle of the second frame's write.
    let path = segment_path(dir.path(), intact.segment);
    let file = OpenOptions::new().write(true).open(&path).expect("open");
    file.set_len(intact.offset + 5).expect("truncate");
    let (records, end) = all(dir.path());
    assert_eq!(records.len(), 1);
    assert!(end.torn_tail, "a scan reports the torn tail");

    let (mut log, torn) = Appender::open(dir.path(), SEGMENT_BYTES).expect("reopen");
    assert!(torn);
    assert_eq!(log.end(), intact, "the torn bytes are gone");
    log.queue(frames(&[("d3", 3, &[ev(3, "e3", r#"{"id":"e3"}"#)])]));
    log.commit().expect("commit");
    let (records, end) = all(dir.path());
    let delivered: Vec<_> = records.iter().map(|(_, r)| r.delivery.as_str()).collect();
    assert_eq!(delivered, vec!["d1", "d3"]);
    assert!(!end.torn_tail);
}

#[test]
fn segments_rotate_at_the_size_limit_and_a_scan_crosses_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, _) = Appender::open(dir.path(), 100).expect("open");
    let mut at = Vec::new();
    for i in 0..5u64 {
        let id = format!("e{i}");
        let raw = format!(r#"{{"id":"{id}","pad":"{}"}}"#, "x".repeat(40));
        at.extend(log.queue(frames(&[("d", i as Millis, &[ev(i, &id, &raw)])])));
        log.commit().expect("commit");
    }
    let segs = segments(dir.path()).expect("segments");
    assert_eq!(segs, vec![1, 2, 3, 4, 5, 6], "each frame fills a segment");
    assert_eq!(
        log.end(),
        LogPosition {
            segment: 6,
            offset: 0
        }
    );
    for (i, loc) in at.iter().enumerate() {
        let record = read_at(dir.path(), *loc).expect("read").expect("frame");
        assert_eq!(record.seqs, vec![i as u64]);
    }
    // From the middle: the third frame on.
    let mut seen = Vec::new();
    scan(dir.path(), at[2], |_, r, _| {
        seen.push(r.seqs[0]);
        ControlFlow::Continue(())
    })
    .expect("scan");
    assert_eq!(seen, vec![2, 3, 4]);
    // Pruned segments are skipped; a location inside one reads as gone.
    remove_segment(dir.path(), 1).expect("remove");
    assert!(read_at(dir.path(), at[0]).expect("read").is_none());
    let (records, _) = all(dir.path());
    assert_eq!(records.len(), 4);
    assert!(size(dir.path()) > 0);
}

#[test]
fn a_bad_frame_in_an_older_segment_is_corruption() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, _) = Appender::open(dir.path(), 10).expect("open");
    for i in 0..2u64 {
        log.queue(frames(&[("d", 1, &[ev(i, "e", r#"{"id":"e"}"#)])]));
        log.commit().expect("commit");
    }
    let path = segment_path(dir.path(), 1);
    let mut bytes = std::fs::read(&path).expect("read");
    bytes[12] ^= 0xff;
    std::fs::write(&path, &bytes).expect("write");
    let err = scan(dir.path(), LogPosition::default(), |_, _, _| {
        ControlFlow::Continue(())
    })
    .expect_err("corrupt");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    assert!(err.to_string().contains("corrupt"), "{err}");
}

#[test]
fn discarded_frames_are_never_written_and_locations_sort_in_log_order() {
    let a = LogPosition {
        segment: 1,
        offset: 900,
    };
    let b = LogPosition {
        segment: 2,
        offset: 3,
    };
    assert!(
        a.encode() < b.encode(),
        "encoded locations sort in log order"
    );
    assert_eq!(LogPosition::decode(&b.encode()), Some(b));
    assert_eq!(LogPosition::decode(b"short"), None);

    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, _) = Appender::open(dir.path(), SEGMENT_BYTES).expect("open");
    log.queue(frames(&[("d1", 1, &[ev(1, "e1", r#"{"id":"e1"}"#)])]));
    log.discard_pending();
    log.commit().expect("nothing to commit");
    assert_eq!(
        log.end(),
        LogPosition {
            segment: 1,
            offset: 0
        }
    );
    assert!(all(dir.path()).0.is_empty());
}

#[test]
fn a_layout_1_intake_log_reads_with_empty_index_fields() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("intake.wal");
    let payload = br#"{"d":"d1","t":5,"e":[{"id":"e1"}]}"#;
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    bytes.extend_from_slice(payload);
    bytes.extend_from_slice(&[1, 2, 3]); // a torn tail
    std::fs::write(&path, &bytes).expect("write");
    let records = read_legacy(&path).expect("read");
    assert_eq!(records.len(), 1);
    assert!(records[0].seqs.is_empty());
    assert_eq!(records[0].events[0].get(), r#"{"id":"e1"}"#);
    assert!(read_legacy(&dir.path().join("absent"))
        .expect("read")
        .is_empty());
}

/// Three committed frames; returns the log's directory and where each frame starts.
fn three_frames() -> (tempfile::TempDir, Vec<LogPosition>, LogPosition) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, _) = Appender::open(dir.path(), SEGMENT_BYTES).expect("open");
    let at = log.queue(frames(&[
        ("d1", 1, &[ev(1, "e1", r#"{"id":"e1"}"#)]),
        ("d2", 2, &[ev(2, "e2", r#"{"id":"e2"}"#)]),
        ("d3", 3, &[ev(3, "e3", r#"{"id":"e3"}"#)]),
    ]));
    log.commit().expect("commit");
    let end = log.end();
    (dir, at, end)
}

fn overwrite(path: &Path, at: u64, bytes: &[u8]) {
    let mut file = OpenOptions::new().write(true).open(path).expect("open");
    file.seek(SeekFrom::Start(at)).expect("seek");
    file.write_all(bytes).expect("write");
}

#[test]
fn check_tail_tells_a_torn_write_from_damage_a_crash_cannot_cause() {
    // A write cut short, and a tail of zeros (size extended, data never written): torn.
    let (dir, at, _) = three_frames();
    let path = segment_path(dir.path(), 1);
    OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open")
        .set_len(at[2].offset + 7)
        .expect("cut");
    let tail = check_tail(dir.path()).expect("torn");
    assert_eq!(
        tail,
        Tail::Torn {
            segment: 1,
            good: at[2].offset
        }
    );
    tail.check_indexed(dir.path(), at[1])
        .expect("past the index");
    let (dir, _, end) = three_frames();
    let path = segment_path(dir.path(), 1);
    OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open")
        .set_len(end.offset + 4096)
        .expect("extend");
    assert_eq!(
        check_tail(dir.path()).expect("zeros"),
        Tail::Torn {
            segment: 1,
            good: end.offset
        }
    );

    // Garbage in the middle frame, the last one intact after it: corruption, and the file is
    // not touched.
    let (dir, at, end) = three_frames();
    let path = segment_path(dir.path(), 1);
    overwrite(&path, at[1].offset + 10, b"garbage");
    let before = std::fs::read(&path).expect("read");
    let err = check_tail(dir.path()).expect_err("corrupt");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    let text = err.to_string();
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert!(
        text.contains(&format!("at byte {}", at[1].offset)),
        "{text}"
    );
    assert!(
        text.contains(&format!("follows at byte {}", at[2].offset)),
        "{text}"
    );
    assert_eq!(std::fs::read(&path).expect("read"), before);
    assert_eq!(end.segment, 1);

    // The last frame damaged, but already indexed: corruption too.
    let (dir, at, end) = three_frames();
    overwrite(&segment_path(dir.path(), 1), at[2].offset + 9, b"xx");
    let tail = check_tail(dir.path()).expect("a torn tail, as far as the log can tell");
    tail.check_indexed(dir.path(), at[1])
        .expect("not indexed yet");
    let err = tail.check_indexed(dir.path(), end).expect_err("indexed");
    assert!(err.to_string().contains("indexed"), "{err}");
}
