//! [`Sym`]: a label name or value, an immutable string behind an `Arc`.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;

use triomphe::ThinArc;

/// A label name or value: an immutable, shared string. A clone is a
/// reference count's increment, where a `String`'s was an allocation and a
/// copy: a PromQL answer copies every label of every series it returns
/// (12 % of a dashboard panel of 1,000 GPUs, callgrind of the server), and
/// a key's labels are shared by its series' segments and queries. Compares,
/// orders and hashes as the `str` it holds, so a map keyed by `Sym` is
/// looked up by `&str`.
///
/// A thin pointer (the length is in the allocation, beside the count), so a
/// [`crate::Label`] is 16 bytes, not 32: a GPU's label set of a dozen labels
/// is shared by its fifty series, but the head and every answer hold sets.
#[derive(Clone)]
pub struct Sym(ThinArc<(), u8>);

impl Sym {
    fn new(s: &str) -> Self {
        Self(ThinArc::from_header_and_slice((), s.as_bytes()))
    }

    pub fn as_str(&self) -> &str {
        // SAFETY: the bytes are those of the `&str` given to `Self::new`,
        // and nothing changes them.
        unsafe { std::str::from_utf8_unchecked(&self.0.slice) }
    }

    /// Holders of this string, this one included.
    pub(crate) fn holders(&self) -> usize {
        ThinArc::strong_count(&self.0)
    }
}

impl Default for Sym {
    fn default() -> Self {
        Self::new("")
    }
}

impl PartialEq for Sym {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Sym {}

impl PartialOrd for Sym {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Sym {
    fn cmp(&self, other: &Self) -> Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl Hash for Sym {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl Deref for Sym {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for Sym {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for Sym {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Debug for Sym {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Sym {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.as_str(), f)
    }
}

impl From<&str> for Sym {
    fn from(s: &str) -> Self {
        Self::new(s)
    }
}

impl From<&String> for Sym {
    fn from(s: &String) -> Self {
        Self::new(s)
    }
}

impl From<String> for Sym {
    fn from(s: String) -> Self {
        Self::new(&s)
    }
}

impl From<&Sym> for Sym {
    fn from(s: &Sym) -> Self {
        s.clone()
    }
}

impl From<Sym> for String {
    fn from(s: Sym) -> Self {
        String::from(s.as_str())
    }
}

impl PartialEq<str> for Sym {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Sym {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for Sym {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other.as_str()
    }
}

impl PartialEq<Sym> for str {
    fn eq(&self, other: &Sym) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<Sym> for &str {
    fn eq(&self, other: &Sym) -> bool {
        *self == other.as_str()
    }
}

impl PartialEq<Sym> for String {
    fn eq(&self, other: &Sym) -> bool {
        self.as_str() == other.as_str()
    }
}

impl serde::Serialize for Sym {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
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
