use super::*;

fn node(id: &str, grpc: &str) -> NodeAddress {
    NodeAddress {
        id: id.into(),
        grpc: grpc.into(),
    }
}

#[test]
fn seeds_are_a_comma_separated_list_of_urls() {
    assert_eq!(
        seeds("grpc://10.0.0.1:7400, http://10.0.0.2:7400,").unwrap(),
        ["grpc://10.0.0.1:7400", "http://10.0.0.2:7400"]
    );
    assert_eq!(seeds("grpc://a:1").unwrap(), ["grpc://a:1"]);
    let none = seeds(" , ").unwrap_err().to_string();
    assert!(none.contains("at least one seed"), "{none}");
    let bad = seeds("grpc://a:1,http://b c:2").unwrap_err().to_string();
    assert!(bad.contains("invalid ingest URL \"http://b c:2\""), "{bad}");
}

#[test]
fn an_owners_answer_is_checked_before_use() {
    let ok = owners_from(&[node("b", "127.0.0.1:7410"), node("a-1.x_y", "[::1]:7400")]).unwrap();
    assert_eq!(
        ok,
        [
            Owner {
                id: "b".into(),
                url: "http://127.0.0.1:7410".into()
            },
            Owner {
                id: "a-1.x_y".into(),
                url: "http://[::1]:7400".into()
            }
        ]
    );
    let cases: [(Vec<NodeAddress>, &str); 8] = [
        (vec![], "empty"),
        (vec![node("", "127.0.0.1:1")], "not a valid node id"),
        (vec![node("..", "127.0.0.1:1")], "not a valid node id"),
        (vec![node("a/b", "127.0.0.1:1")], "not a valid node id"),
        (
            vec![node("a", "127.0.0.1:1"), node("a", "127.0.0.1:2")],
            "listed twice",
        ),
        (vec![node("a", "127.0.0.1")], "is not host:port"),
        (vec![node("a", "127.0.0.1:99999")], "is not host:port"),
        (vec![node("a", "h:1/x")], "is not host:port"),
    ];
    for (reply, want) in cases {
        let e = owners_from(&reply).expect_err(want);
        assert!(e.contains(want), "{want:?} not in {e:?}");
    }
}

#[test]
fn urls_of_one_node_compare_equal() {
    assert!(same_node("grpc://10.0.0.1:7400", "http://10.0.0.1:7400/"));
    assert!(!same_node("grpc://10.0.0.1:7400", "grpc://10.0.0.1:7401"));
}

#[test]
fn a_spool_remembers_its_node() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("b");
    std::fs::create_dir(&d).unwrap();
    assert!(read_addr(&d).unwrap_err().contains("owner.addr"));
    write_addr(&d, "http://127.0.0.1:7410").unwrap();
    assert_eq!(
        std::fs::read_to_string(d.join(OWNER_ADDR_FILE)).unwrap(),
        "http://127.0.0.1:7410\n"
    );
    assert_eq!(read_addr(&d).unwrap(), "http://127.0.0.1:7410");
    std::fs::write(d.join(OWNER_ADDR_FILE), "not a url at all\n").unwrap();
    assert!(read_addr(&d).is_err());
}
