use super::*;

/// SHA-256("abc"), FIPS 180-2's first test vector.
const ABC: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

fn file() -> String {
    format!(
        "[[token]]\nname = \"grafana\"\nscopes = [\"read\"]\nsha256 = \"{ABC}\"\n\n\
         [[token]]\nname = \"ops\"\nscopes = [\"read\", \"admin\"]\nsha256 = \"{}\"\n",
        // SHA-256 of the empty string, the other standard vector.
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )
}

#[test]
fn hash_is_sha256_hex() {
    assert_eq!(hash("abc"), ABC);
}

#[test]
fn verify_finds_the_entry_by_hash() {
    let t = Tokens::parse(&file()).unwrap();
    let (name, scopes) = t.verify("abc").unwrap();
    assert_eq!(name, "grafana");
    assert_eq!(scopes.names(), ["read"]);
    let (name, scopes) = t.verify("").unwrap();
    assert_eq!(name, "ops");
    assert_eq!(scopes.names(), ["read", "admin"]);
    assert!(t.verify("abd").is_none());
    assert!(t.verify(ABC).is_none(), "the hash itself is not a token");
}

#[test]
fn authorize_checks_the_scope() {
    let t = Tokens::parse(&file()).unwrap();
    assert_eq!(t.authorize("abc", Scope::Read), Ok("grafana"));
    assert_eq!(
        t.authorize("abc", Scope::Write),
        Err(Denial::Scope {
            token: "grafana".into(),
            need: Scope::Write
        })
    );
    assert_eq!(t.authorize("", Scope::Admin), Ok("ops"));
    assert_eq!(t.authorize("nope", Scope::Read), Err(Denial::Invalid));
}

#[test]
fn bad_files_are_refused_with_the_reason() {
    let cases = [
        ("", "no [[token]] entries"),
        (
            "[[token]]\nname = \"a\"\nscopes = [\"read\"]\nsha256 = \"abc\"\n",
            "64 hex digits",
        ),
        (
            "[[token]]\nname = \"a\"\nscopes = [\"root\"]\nsha256 = \"{ABC}\"\n",
            "unknown scope \\\"root\\\"",
        ),
        (
            "[[token]]\nname = \"a\"\nscopes = []\nsha256 = \"{ABC}\"\n",
            "no scopes",
        ),
        (
            "[[token]]\nname = \"a\"\nscopes = [\"read\"]\ntoken = \"gpulse_x\"\n",
            "unknown field",
        ),
        (
            "[[token]]\nname = \"a\"\nscopes = [\"read\"]\nsha256 = \"{ABC}\"\n\
             [[token]]\nname = \"a\"\nscopes = [\"write\"]\nsha256 = \"{E}\"\n",
            "two tokens named",
        ),
        (
            "[[token]]\nname = \"a\"\nscopes = [\"read\"]\nsha256 = \"{ABC}\"\n\
             [[token]]\nname = \"b\"\nscopes = [\"write\"]\nsha256 = \"{ABC}\"\n",
            "hash of an earlier token",
        ),
    ];
    let e = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
    for (text, says) in cases {
        let text = text.replace("{ABC}", ABC).replace("{E}", e);
        let err = Tokens::parse(&text).unwrap_err();
        let says = says.replace("\\\"", "\"");
        assert!(err.contains(&says), "{text:?}: {err:?} should say {says:?}");
    }
}

#[test]
fn presented_takes_bearer_and_basic() {
    assert_eq!(presented(b"Bearer gpulse_t1").as_deref(), Some("gpulse_t1"));
    assert_eq!(
        presented(b"bearer  gpulse_t1 ").as_deref(),
        Some("gpulse_t1")
    );
    // base64("x:gpulse_t1"), from coreutils' base64.
    assert_eq!(
        presented(b"Basic eDpncHVsc2VfdDE=").as_deref(),
        Some("gpulse_t1")
    );
    assert_eq!(presented(b"Bearer "), None);
    assert_eq!(presented(b"gpulse_t1"), None);
    assert_eq!(presented(b"Digest gpulse_t1"), None);
    assert_eq!(presented(b"Basic !!!"), None);
    assert_eq!(presented(&[0xff, 0xfe]), None);
}

#[test]
fn gate_counts_refusals_per_surface_and_reason() {
    let gate = Gate::new(Tokens::parse(&file()).unwrap());
    assert_eq!(
        gate.check(Surface::Http, None, Scope::Read),
        Err(Denial::Missing)
    );
    assert_eq!(
        gate.check(Surface::Http, Some(b"Bearer abd"), Scope::Read),
        Err(Denial::Invalid)
    );
    assert!(
        gate.check(Surface::Grpc, Some(b"Bearer abc"), Scope::Write)
            .is_err()
    );
    assert_eq!(
        gate.check(Surface::Grpc, Some(b"Bearer abc"), Scope::Read),
        Ok(())
    );
    let m = gate.metrics();
    assert_eq!(m.count(Surface::Http, "missing"), 1);
    assert_eq!(m.count(Surface::Http, "invalid"), 1);
    assert_eq!(m.count(Surface::Grpc, "scope"), 1);
    assert_eq!(m.count(Surface::Grpc, "missing"), 0);
    let mut out = String::new();
    m.render(&mut out);
    assert!(out.contains("gpulse_auth_refused_total{surface=\"grpc\",reason=\"scope\"} 1\n"));
    assert!(out.contains("gpulse_auth_refused_total{surface=\"postgres\",reason=\"invalid\"} 0\n"));
}

#[test]
fn interceptor_maps_denials_to_grpc_codes() {
    let gate = Arc::new(Gate::new(Tokens::parse(&file()).unwrap()));
    let mut check = interceptor(Some(gate), Surface::Grpc, Scope::Write);
    let mut with = |v: Option<&'static str>| {
        let mut r = tonic::Request::new(());
        if let Some(v) = v {
            r.metadata_mut().insert("authorization", v.parse().unwrap());
        }
        check(r).map(|_| ()).map_err(|s| s.code())
    };
    assert_eq!(with(None), Err(tonic::Code::Unauthenticated));
    assert_eq!(with(Some("Bearer zzz")), Err(tonic::Code::Unauthenticated));
    assert_eq!(with(Some("Bearer abc")), Err(tonic::Code::PermissionDenied));
    let mut open = interceptor(None, Surface::Grpc, Scope::Write);
    assert!(open(tonic::Request::new(())).is_ok());
}

#[test]
fn new_tokens_are_distinct_and_round_trip_through_an_entry() {
    let (a, b) = (new_token(), new_token());
    assert_ne!(a, b);
    assert_eq!(a.len(), "gpulse_".len() + 64);
    let text = entry("ci", Scopes::of(&[Scope::Write, Scope::Read]), &a);
    let t = Tokens::parse(&text).unwrap();
    assert_eq!(t.authorize(&a, Scope::Write), Ok("ci"));
    assert_eq!(t.authorize(&b, Scope::Write), Err(Denial::Invalid));
}
