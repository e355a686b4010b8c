use std::collections::BTreeSet;
use std::path::Path;

use super::*;

const THREE: &str = r#"
# three nodes on loopback
replication_factor = 2

[[node]]
id = "a"
grpc = "127.0.0.1:7400"
http = "127.0.0.1:7401"
flight = "127.0.0.1:7403"

[[node]]
id = "b"
grpc = "127.0.0.1:7410"
http = "127.0.0.1:7411"
flight = "127.0.0.1:7413"

[[node]]
id = "c"
grpc = "127.0.0.1:7420"
http = "127.0.0.1:7421"
flight = "127.0.0.1:7423"
"#;

fn parse(text: &str) -> Result<ShardMap, ClusterError> {
    ShardMap::parse(text, Path::new("cluster.toml"))
}

fn err(text: &str) -> String {
    parse(text).expect_err("must be refused").to_string()
}

fn racks(n: usize) -> Vec<ShardKey> {
    (0..n)
        .map(|i| ShardKey::Rack(format!("rack-{i:04}")))
        .collect()
}

#[test]
fn a_valid_file_parses_with_one_eternal_epoch() {
    let m = parse(THREE).unwrap();
    assert_eq!(m.replication_factor(), 2);
    assert_eq!(
        m.nodes().iter().map(|n| n.id.as_str()).collect::<Vec<_>>(),
        ["a", "b", "c"]
    );
    assert_eq!(m.nodes()[1].flight, "127.0.0.1:7413".parse().unwrap());
    assert_eq!(
        m.epochs(),
        [Epoch {
            start_ms: i64::MIN,
            members: vec![0, 1, 2]
        }]
    );
    assert_eq!(m.node_index("c"), Some(2));
    assert_eq!(m.node_index("z"), None);
}

#[test]
fn the_hash_ignores_layout_and_node_order_but_not_content() {
    let base = parse(THREE).unwrap();
    assert_eq!(base.hash().len(), 16);
    // Same content: comments, blank lines and [[node]] order do not matter.
    let mut blocks: Vec<&str> = THREE.split("[[node]]").collect();
    let head = blocks.remove(0);
    blocks.reverse();
    let reordered = format!("{head}\n# reordered\n[[node]]{}", blocks.join("[[node]]"));
    assert_eq!(parse(&reordered).unwrap().hash(), base.hash());
    // Any change of meaning changes it.
    for changed in [
        THREE.replace("replication_factor = 2", "replication_factor = 3"),
        THREE.replace("127.0.0.1:7413", "127.0.0.1:7414"),
        THREE.replace("id = \"c\"", "id = \"d\""),
    ] {
        assert_ne!(parse(&changed).unwrap().hash(), base.hash(), "{changed}");
    }
}

#[test]
fn bad_files_are_refused_with_the_reason() {
    let cases: [(String, &str); 12] = [
        ("replication_factor = 2".into(), "no [[node]] entries"),
        (
            THREE.replace("replication_factor = 2", ""),
            "replication_factor is missing",
        ),
        (
            THREE.replace("replication_factor = 2", "replication_factor = 0"),
            "at least 1",
        ),
        (
            THREE.replace("replication_factor = 2", "replication_factor = 4"),
            "has only 3 node(s)",
        ),
        (THREE.replace("id = \"b\"", "id = \"a\""), "appears twice"),
        (THREE.replace("id = \"b\"", "id = \"\""), "id is empty"),
        (THREE.replace("id = \"b\"", "id = \"b c\""), "may hold only"),
        (
            THREE.replace("127.0.0.1:7411", "localhost"),
            "http = \"localhost\" is not host:port",
        ),
        (
            THREE.replace("127.0.0.1:7411", "127.0.0.1:7401"),
            "also used by another listener",
        ),
        (
            THREE.replace("flight = \"127.0.0.1:7423\"", ""),
            "missing field `flight`",
        ),
        (format!("{THREE}\nshards = 3\n"), "unknown field `shards`"),
        ("replication_factor = \"two\"".into(), "invalid type"),
    ];
    for (text, want) in cases {
        let e = err(&text);
        assert!(e.starts_with("cluster file cluster.toml: "), "{e}");
        assert!(e.contains(want), "{want:?} not in {e:?}");
    }
    let missing = ShardMap::load(Path::new("/nonexistent/cluster.toml")).unwrap_err();
    assert!(
        missing
            .to_string()
            .contains("cannot read the cluster file /nonexistent/cluster.toml")
    );
}

#[test]
fn epochs_are_validated() {
    let epoch =
        |start: &str, nodes: &str| format!("\n[[epoch]]\nstart = {start:?}\nnodes = [{nodes}]\n");
    let cases = [
        (epoch("yesterday", "\"a\", \"b\""), "RFC 3339"),
        (
            epoch("2026-11-30T00:00:00Z", "\"a\", \"x\""),
            "node \"x\" has no [[node]] entry",
        ),
        (
            epoch("2026-11-30T00:00:00Z", "\"a\", \"a\""),
            "listed twice",
        ),
        (
            epoch("2026-11-30T00:00:00Z", "\"a\""),
            "epoch #1 has only 1 node(s)",
        ),
        (
            epoch("2026-11-30T00:00:00Z", "\"a\", \"b\"")
                + &epoch("2026-11-29T00:00:00Z", "\"a\", \"b\""),
            "list epochs oldest first",
        ),
    ];
    for (tail, want) in cases {
        let e = err(&format!("{THREE}{tail}"));
        assert!(e.contains(want), "{want:?} not in {e:?}");
    }
}

#[test]
fn the_hash_function_is_xxh64_and_pinned() {
    // XXH64 of the empty input with seed 0, from the xxHash reference.
    assert_eq!(twox_hash::XxHash64::oneshot(0, b""), 0xEF46_DB37_51D8_E999);
    // Owners of these keys must never change between versions: data already
    // written sits on them. Recorded when the map was introduced.
    let m = parse(THREE).unwrap();
    let ids = |key: &ShardKey| -> Vec<&str> {
        m.owners_at(key, 0)
            .iter()
            .map(|&i| m.nodes()[i].id.as_str())
            .collect()
    };
    assert_eq!(ids(&ShardKey::Rack("r0".into())), PINNED_R0);
    assert_eq!(ids(&ShardKey::Rack("r1".into())), PINNED_R1);
    assert_eq!(ids(&ShardKey::Host("h0".into())), PINNED_H0);
}

#[test]
fn owners_are_the_top_scores_and_balanced() {
    let m = parse(THREE).unwrap();
    let mut owned = [0usize; 3];
    for key in racks(3000) {
        let owners = m.owners_at(&key, 0);
        assert_eq!(owners.len(), 2);
        assert_ne!(owners[0], owners[1]);
        // The one non-owner has the lowest score.
        let other = (0..3).find(|i| !owners.contains(i)).unwrap();
        for &o in &owners {
            assert!(
                rendezvous_score(&m.nodes()[o].id, &key)
                    > rendezvous_score(&m.nodes()[other].id, &key)
            );
        }
        for o in owners {
            owned[o] += 1;
        }
    }
    // Each node owns about RF/N = 2/3 of the racks.
    for n in owned {
        assert!((1800..=2200).contains(&n), "{owned:?}");
    }
}

#[test]
fn a_host_without_a_rack_is_its_own_key() {
    assert_eq!(ShardKey::of("", "h1"), ShardKey::Host("h1".into()));
    assert_eq!(ShardKey::of("r7", "h1"), ShardKey::Rack("r7".into()));
    // "rack/x" and "host/x" hash apart.
    let m = parse(THREE).unwrap();
    let differ = (0..200).any(|i| {
        let n = format!("x{i}");
        m.owners_at(&ShardKey::Rack(n.clone()), 0) != m.owners_at(&ShardKey::Host(n), 0)
    });
    assert!(differ);
}

#[test]
fn the_placement_rule_reads_rack_then_hostname_then_lowercase_hostname() {
    let key = |labels: &[(&str, &str)]| {
        ShardKey::of_labels(|name| labels.iter().find(|(n, _)| *n == name).map(|(_, v)| *v))
    };
    let rack = |r: &str| ShardKey::Rack(r.into());
    let host = |h: &str| ShardKey::Host(h.into());
    assert_eq!(key(&[("rack", "r1"), ("Hostname", "h1")]), rack("r1"));
    assert_eq!(key(&[("Hostname", "h1"), ("hostname", "h2")]), host("h1"));
    assert_eq!(key(&[("hostname", "h2")]), host("h2"));
    // An empty rack is no rack; no host label at all is the empty host.
    assert_eq!(key(&[("rack", ""), ("hostname", "h2")]), host("h2"));
    assert_eq!(key(&[("__name__", "DCGM_FI_DEV_GPU_TEMP")]), host(""));
    // The borrowed form reads the same labels.
    let borrowed = |labels: &'static [(&'static str, &'static str)]| {
        ShardRef::of_labels(|name| labels.iter().find(|(n, _)| *n == name).map(|(_, v)| *v))
    };
    assert_eq!(
        borrowed(&[("rack", "r1"), ("Hostname", "h1")]),
        ShardRef::Rack("r1")
    );
    assert_eq!(
        borrowed(&[("rack", ""), ("hostname", "h2")]),
        ShardRef::Host("h2")
    );
    assert_eq!(
        borrowed(&[("Hostname", "h1"), ("hostname", "h2")]),
        ShardRef::Host("h1")
    );
    assert_eq!(borrowed(&[]), ShardRef::Host(""));
}

fn four_with_epochs() -> ShardMap {
    let text = THREE.to_owned()
        + r#"
[[node]]
id = "d"
grpc = "127.0.0.1:7430"
http = "127.0.0.1:7431"
flight = "127.0.0.1:7433"

[[epoch]]
start = "2026-11-01T00:00:00Z"
nodes = ["a", "b", "c"]

[[epoch]]
start = "2026-11-30T12:00:00.500Z"
nodes = ["d", "a", "b", "c"]
"#;
    parse(&text).unwrap()
}

#[test]
fn adding_a_node_moves_only_what_it_takes() {
    let m = four_with_epochs();
    let d = m.node_index("d").unwrap();
    let (mut moved, n) = (0, 3000);
    for key in racks(n) {
        let before: HashSet<usize> = m.owners_in(0, &key).into_iter().collect();
        let after: HashSet<usize> = m.owners_in(1, &key).into_iter().collect();
        assert!(!before.contains(&d));
        if before != after {
            // Exactly one replica moved, and it moved to the new node.
            assert!(after.contains(&d), "{key}: {before:?} -> {after:?}");
            assert_eq!(before.intersection(&after).count(), 1, "{key}");
            moved += 1;
        }
    }
    // The new node enters the top 2 of 4 for about half the racks.
    assert!((n * 2 / 5..=n * 3 / 5).contains(&moved), "{moved} of {n}");
}

#[test]
fn epochs_answer_by_time() {
    let m = four_with_epochs();
    let change = chrono::DateTime::parse_from_rfc3339("2026-11-30T12:00:00.500Z")
        .unwrap()
        .timestamp_millis();
    assert_eq!(m.epochs()[1].start_ms, change);
    assert_eq!(m.epochs()[1].members, [0, 1, 2, 3]);
    assert_eq!(m.epoch_at(0), 0, "before the first epoch: the first");
    assert_eq!(m.epoch_at(change - 1), 0);
    assert_eq!(m.epoch_at(change), 1);
    assert_eq!(m.epochs_overlapping(0, change - 1), [0]);
    assert_eq!(m.epochs_overlapping(0, change), [0, 1]);
    assert_eq!(m.epochs_overlapping(change, i64::MAX), [1]);
    assert_eq!(m.epochs_overlapping(change + 10, change + 20), [1]);
}

// Computed outside this code, by a from-scratch XXH64 in Python (the reference
// algorithm), sorting a, b, c by xxh64(id ‖ 0x00 ‖ key) descending.
const PINNED_R0: [&str; 2] = ["c", "a"];
const PINNED_R1: [&str; 2] = ["b", "c"];
const PINNED_H0: [&str; 2] = ["c", "b"];

mod plan {
    use super::*;

    #[test]
    fn every_key_is_read_once_from_a_live_owner() {
        let m = parse(THREE).unwrap();
        let keys = racks(64);
        let all = m.plan_read(&keys, 0, 1000, |_| true, None);
        assert!(all.missing.is_empty());
        let mut seen = BTreeSet::new();
        for (node, ks) in &all.assignments {
            for k in ks {
                assert!(seen.insert(k.clone()), "{k} read twice");
                assert_eq!(m.owners_at(k, 0)[0], *node, "best owner first");
            }
        }
        assert_eq!(seen.len(), 64);

        // The asking node reads what it owns itself.
        let local = m.plan_read(&keys, 0, 1000, |_| true, Some(1));
        for k in &keys {
            if m.owners_at(k, 0).contains(&1) {
                assert!(local.assignments[&1].contains(k));
            }
        }

        // Node 0 down: its keys fail over to the other owner; nothing missing.
        let down0 = m.plan_read(&keys, 0, 1000, |n| n != 0, None);
        assert!(down0.missing.is_empty());
        assert!(!down0.assignments.contains_key(&0));
        assert_eq!(
            down0.assignments.values().map(BTreeSet::len).sum::<usize>(),
            64
        );

        // Nodes 0 and 1 down: exactly the keys owned by {0, 1} are missing.
        let down01 = m.plan_read(&keys, 0, 1000, |n| n == 2, None);
        let want: Vec<&ShardKey> = keys
            .iter()
            .filter(|k| !m.owners_at(k, 0).contains(&2))
            .collect();
        assert!(!want.is_empty());
        assert_eq!(
            down01.missing.iter().map(|m| &m.key).collect::<Vec<_>>(),
            want
        );
        for miss in &down01.missing {
            let mut o = miss.owners.clone();
            o.sort_unstable();
            assert_eq!(o, [0, 1]);
        }
    }

    /// A balanced plan reads every key once from one of its owners and
    /// spreads the keys over the nodes, where preferring the asking node
    /// gives it every key it owns.
    #[test]
    fn a_balanced_plan_spreads_the_keys_over_their_owners() {
        let m = parse(THREE).unwrap();
        let keys = racks(90);
        let loads = |p: &ReadPlan| -> Vec<usize> {
            (0..3)
                .map(|n| p.assignments.get(&n).map_or(0, BTreeSet::len))
                .collect()
        };
        let owned_by_1 = keys
            .iter()
            .filter(|k| m.owners_at(k, 0).contains(&1))
            .count();
        let local = m.plan_read_by(&keys, 0, 1000, |_| true, Prefer::Node(1));
        assert_eq!(loads(&local)[1], owned_by_1);
        assert!(
            owned_by_1 > 45,
            "with two owners of three, node 1 owns about 60"
        );

        let balanced = m.plan_read_by(&keys, 0, 1000, |_| true, Prefer::Balance);
        assert!(balanced.missing.is_empty());
        let mut seen = BTreeSet::new();
        for (node, ks) in &balanced.assignments {
            for k in ks {
                assert!(seen.insert(k.clone()), "{k} read twice");
                assert!(m.owners_at(k, 0).contains(node), "{k} read from {node}");
            }
        }
        assert_eq!(seen.len(), 90);
        for load in loads(&balanced) {
            assert!((28..=32).contains(&load), "{:?}", loads(&balanced));
        }

        // A node down: the other two share its keys and theirs.
        let down0 = m.plan_read_by(&keys, 0, 1000, |n| n != 0, Prefer::Balance);
        assert!(down0.missing.is_empty());
        let l = loads(&down0);
        assert_eq!((l[0], l[1] + l[2]), (0, 90));
    }

    #[test]
    fn a_range_across_an_epoch_change_asks_the_owners_of_both() {
        let m = four_with_epochs();
        let change = m.epochs()[1].start_ms;
        let keys = racks(200);
        let before = m.plan_read(&keys, 0, change - 1, |_| true, None);
        let spanning = m.plan_read(&keys, 0, change + 1000, |_| true, None);
        let nodes_for = |p: &ReadPlan, k: &ShardKey| -> BTreeSet<usize> {
            p.assignments
                .iter()
                .filter(|(_, ks)| ks.contains(k))
                .map(|(n, _)| *n)
                .collect()
        };
        let mut both = 0;
        for k in &keys {
            let old = m.owners_in(0, k);
            let new = m.owners_in(1, k);
            assert_eq!(nodes_for(&before, k).len(), 1);
            // The best old owner stays in the top 2 when one node joins, so
            // with everyone up one node covers both epochs.
            assert_eq!(nodes_for(&spanning, k), BTreeSet::from([old[0]]), "{k}");
            // Without it, one node of each epoch's owner set is asked.
            let failover = m.plan_read([k], 0, change + 1000, |n| n != old[0], None);
            let asked = nodes_for(&failover, k);
            assert!(failover.missing.is_empty(), "{k}");
            assert!(asked.iter().any(|n| old.contains(n)), "{k}");
            assert!(asked.iter().any(|n| new.contains(n)), "{k}");
            both += usize::from(asked.len() == 2);
        }
        // The second old owner is the one the new node displaced: two nodes.
        assert!(both > 0);
    }
}

mod state {
    use std::collections::BTreeMap;

    use gpulse_proto::v1::NodeStatusReply;

    use super::*;

    fn status(id: &str, hash: &str, racks: &[&str]) -> NodeStatusReply {
        NodeStatusReply {
            node_id: id.into(),
            map_hash: hash.into(),
            racks: racks.iter().map(|r| (*r).to_owned()).collect(),
            ..NodeStatusReply::default()
        }
    }

    #[test]
    fn backlogs_are_summed_per_node_and_an_empty_report_clears_one() {
        let s = ClusterState::new(parse(THREE).unwrap(), "a");
        s.set_backlog(
            "agent-1",
            BTreeMap::from([("b".into(), 3), ("c".into(), 0)]),
        );
        s.set_backlog(
            "agent-2",
            BTreeMap::from([("b".into(), 4), ("c".into(), 2)]),
        );
        assert_eq!(
            s.backlog_by_node(),
            BTreeMap::from([("b".into(), 7), ("c".into(), 2)])
        );
        s.set_backlog("agent-2", BTreeMap::from([("b".into(), 0)]));
        assert_eq!(
            s.backlog_by_node(),
            BTreeMap::from([("b".into(), 3), ("c".into(), 0)])
        );
    }

    #[test]
    fn shards_known_anywhere_stay_known_while_their_holder_is_down() {
        let map = parse(THREE).unwrap();
        let hash = map.hash().to_owned();
        let s = ClusterState::new(map, "a");
        s.note_key(ShardKey::Rack("r1".into()));
        s.update_peer("b", Ok(status("b", &hash, &["r2"])));
        s.update_peer("c", Err("connection refused".into()));
        assert!(s.is_up(0) && s.is_up(1) && !s.is_up(2));
        let known: Vec<ShardKey> = s.known_keys().into_iter().collect();
        assert_eq!(
            known,
            [ShardKey::Rack("r1".into()), ShardKey::Rack("r2".into())]
        );
        // c never answered: whatever only it holds is unknown, and said so.
        let warnings = s.preflight().unwrap();
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0].contains("node c is down and has not reported"),
            "{warnings:?}"
        );
        // b goes down: its shards stay known.
        s.update_peer("b", Err("timeout".into()));
        assert!(!s.is_up(1));
        assert!(s.known_keys().contains(&ShardKey::Rack("r2".into())));
    }

    #[test]
    fn a_peer_with_another_file_makes_cluster_queries_refused() {
        let s = ClusterState::new(parse(THREE).unwrap(), "a");
        s.update_peer("b", Ok(status("b", "0123456789abcdef", &[])));
        let e = s.preflight().unwrap_err();
        assert!(
            e.contains("node b runs with cluster file hash 0123456789abcdef"),
            "{e}"
        );
    }

    #[test]
    fn a_reload_keeps_what_remaining_peers_said_and_refuses_a_map_without_this_node() {
        let s = ClusterState::new(parse(THREE).unwrap(), "a");
        s.update_peer("b", Ok(status("b", "x", &["r2"])));
        s.update_peer("c", Ok(status("c", "x", &["r3"])));
        let without_c = THREE.replace("id = \"c\"", "id = \"d\"");
        s.reload(parse(&without_c).unwrap()).unwrap();
        assert!(s.known_keys().contains(&ShardKey::Rack("r2".into())));
        assert!(!s.known_keys().contains(&ShardKey::Rack("r3".into())));
        assert_eq!(s.map().node_index("d"), Some(2));
        let without_a = THREE.replace("id = \"a\"", "id = \"e\"");
        let e = s.reload(parse(&without_a).unwrap()).unwrap_err();
        assert!(e.contains("\"a\" is not in the new cluster file"), "{e}");
        assert_eq!(s.map().node_index("d"), Some(2), "the old map stays");
    }

    #[test]
    fn the_generation_moves_when_what_reads_are_planned_from_changes() {
        let map = parse(THREE).unwrap();
        let hash = map.hash().to_owned();
        let s = ClusterState::new(map, "a");
        let mut g = s.generation();
        let mut moved = |s: &ClusterState| {
            let now = s.generation();
            std::mem::replace(&mut g, now) != now
        };
        s.update_peer("b", Ok(status("b", &hash, &["r2"])));
        assert!(moved(&s), "first answer");
        s.update_peer("b", Ok(status("b", &hash, &["r2"])));
        assert!(!moved(&s), "the same answer");
        s.update_peer("b", Ok(status("b", &hash, &["r2", "r3"])));
        assert!(moved(&s), "a shard more");
        s.update_peer("b", Err("timeout".into()));
        assert!(moved(&s), "down");
        s.update_peer("b", Err("timeout".into()));
        assert!(!moved(&s), "still down");
        s.update_peer("c", Err("connection refused".into()));
        assert!(!moved(&s), "never up");
        s.update_peer("b", Ok(status("b", &hash, &["r2", "r3"])));
        assert!(moved(&s), "up again");
        s.update_peer("b", Ok(status("b", "0123456789abcdef", &["r2", "r3"])));
        assert!(moved(&s), "another cluster file");
        s.note_key(ShardKey::Rack("r9".into()));
        assert!(
            !moved(&s),
            "this node's own shards are read whether known or not"
        );
        s.reload(parse(THREE).unwrap()).unwrap();
        assert!(moved(&s), "a reload");
    }
}
