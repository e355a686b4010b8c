//! [`Sym`]: a label name or value, an immutable string behind an `Arc`.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// A label name or value: an immutable, shared string. A clone is a
/// reference count's increment, where a `String`'s was an allocation and a
/// copy: a PromQL answer copies every label of every series it returns
/// (12 % of a dashboard panel of 1,000 GPUs, callgrind of the server), and
/// a key's labels are shared by its series' segments and queries. Compares,
/// orders and hashes as the `str` it holds, so a map keyed by `Sym` is
/// looked up by `&str`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sym(Arc<str>);

impl Sym {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for Sym {
    fn default() -> Self {
        Self(Arc::from(""))
    }
}

impl Deref for Sym {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Sym {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for Sym {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Sym {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Sym {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl From<&str> for Sym {
    fn from(s: &str) -> Self {
        Self(Arc::from(s))
    }
}

impl From<&String> for Sym {
    fn from(s: &String) -> Self {
        Self(Arc::from(s.as_str()))
    }
}

impl From<String> for Sym {
    fn from(s: String) -> Self {
        Self(Arc::from(s))
    }
}

impl From<&Sym> for Sym {
    fn from(s: &Sym) -> Self {
        s.clone()
    }
}

impl From<Sym> for String {
    fn from(s: Sym) -> Self {
        String::from(&*s.0)
    }
}

impl PartialEq<str> for Sym {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for Sym {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl PartialEq<String> for Sym {
    fn eq(&self, other: &String) -> bool {
        *self.0 == **other
    }
}

impl PartialEq<Sym> for str {
    fn eq(&self, other: &Sym) -> bool {
        self == &*other.0
    }
}

impl PartialEq<Sym> for &str {
    fn eq(&self, other: &Sym) -> bool {
        *self == &*other.0
    }
}

impl PartialEq<Sym> for String {
    fn eq(&self, other: &Sym) -> bool {
        **self == *other.0
    }
}

impl serde::Serialize for Sym {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Sym {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Self::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeSet, HashMap};

    #[test]
    fn a_sym_compares_orders_and_hashes_as_its_string() {
        let words = ["gpu", "", "Hostname", "gpu0", "é", "a\"b"];
        for a in words {
            for b in words {
                let (sa, sb) = (Sym::from(a), Sym::from(b));
                assert_eq!(sa == sb, a == b, "{a:?} {b:?}");
                assert_eq!(sa.cmp(&sb), a.cmp(b), "{a:?} {b:?}");
                assert_eq!(sa == b, a == b);
                let owned = String::from(b);
                assert_eq!(owned == sa, a == b);
                assert_eq!(sa == owned, a == b);
                assert_eq!(b == sa, a == b);
            }
        }
        // A map keyed by `Sym` is found by `&str` (`Borrow` hashes alike).
        let map: HashMap<Sym, usize> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (Sym::from(*w), i))
            .collect();
        for (i, w) in words.iter().enumerate() {
            assert_eq!(map.get(*w), Some(&i));
        }
        let sorted: Vec<String> = words
            .iter()
            .map(|w| Sym::from(*w))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .map(String::from)
            .collect();
        let mut expected: Vec<String> = words.iter().map(|w| w.to_string()).collect();
        expected.sort();
        assert_eq!(sorted, expected);
        assert_eq!(format!("{:?}", Sym::from("a\"b")), format!("{:?}", "a\"b"));
        assert_eq!(Sym::default(), "");
        assert_eq!(
            serde_json::to_string(&Sym::from("x\ny")).unwrap(),
            r#""x\ny""#
        );
        assert_eq!(serde_json::from_str::<Sym>(r#""x\ny""#).unwrap(), "x\ny");
    }
}
