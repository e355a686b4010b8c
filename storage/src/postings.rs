//! Label postings, (label name, value) -> ascending series ids, and the
//! selection through them that segments and the head share.

use std::collections::HashMap;

use crate::series::Matcher;

/// Label name -> value -> ascending series ids (the metric name under
/// `__name__`).
pub(crate) type Postings = HashMap<String, HashMap<String, Vec<u32>>>;

/// Adds `id`, greater than every id already listed, under `(name, value)`.
pub(crate) fn add(postings: &mut Postings, name: &str, value: &str, id: u32) {
    match postings.get_mut(name) {
        Some(values) => match values.get_mut(value) {
            Some(ids) => ids.push(id),
            None => {
                values.insert(value.to_owned(), vec![id]);
            }
        },
        None => {
            let values = HashMap::from([(value.to_owned(), vec![id])]);
            postings.insert(name.to_owned(), values);
        }
    }
}

/// The ids that may match all `matchers`, ascending, and the matchers left
/// to test on each of them. Matchers that cannot match an absent label (`=`
/// a non-empty value, `=~` a pattern that does not match "") go through the
/// postings: the union of the lists of every matching value, intersected
/// across matchers; the postings answer those exactly. `None` when no
/// matcher can go through them: every series is a candidate.
pub(crate) fn select<'m>(
    postings: &Postings,
    matchers: &'m [Matcher],
) -> (Option<Vec<u32>>, Vec<&'m Matcher>) {
    let mut candidates: Option<Vec<u32>> = None;
    let mut rest = Vec::new();
    for m in matchers {
        let values = postings.get(m.name());
        let list: Vec<u32> = match m {
            Matcher::Equal { value, .. } if !value.is_empty() => values
                .and_then(|v| v.get(value))
                .cloned()
                .unwrap_or_default(),
            Matcher::Regex { pattern, .. } if !pattern.is_match("") => {
                let mut ids: Vec<u32> = values
                    .into_iter()
                    .flatten()
                    .filter(|(v, _)| pattern.is_match(v))
                    .flat_map(|(_, ids)| ids.iter().copied())
                    .collect();
                ids.sort_unstable();
                ids.dedup();
                ids
            }
            _ => {
                rest.push(m);
                continue;
            }
        };
        candidates = Some(match candidates {
            None => list,
            Some(c) => intersect(&c, &list),
        });
    }
    (candidates, rest)
}

/// The ids in both ascending lists.
fn intersect(a: &[u32], b: &[u32]) -> Vec<u32> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn postings(series: &[&[(&str, &str)]]) -> Postings {
        let mut p = Postings::new();
        for (id, labels) in series.iter().enumerate() {
            for (n, v) in labels.iter() {
                add(&mut p, n, v, id as u32);
            }
        }
        p
    }

    #[test]
    fn postings_answer_equal_and_regex_matchers_and_leave_the_rest() {
        let p = postings(&[
            &[("__name__", "temp"), ("host", "a"), ("gpu", "0")],
            &[("__name__", "temp"), ("host", "b"), ("gpu", "0")],
            &[("__name__", "power"), ("host", "a"), ("gpu", "1")],
            &[("__name__", "temp"), ("host", "ab"), ("gpu", "1")],
        ]);
        let re = |n: &str, p: &str| Matcher::regex(n, p).unwrap();
        let ids = |m: &[Matcher]| select(&p, m).0;
        assert_eq!(
            ids(&[Matcher::equal("__name__", "temp")]),
            Some(vec![0, 1, 3])
        );
        assert_eq!(
            ids(&[
                Matcher::equal("__name__", "temp"),
                Matcher::equal("gpu", "0")
            ]),
            Some(vec![0, 1])
        );
        assert_eq!(ids(&[re("host", "a.*")]), Some(vec![0, 2, 3]));
        assert_eq!(
            ids(&[re("host", "a"), Matcher::equal("gpu", "1")]),
            Some(vec![2])
        );
        assert_eq!(ids(&[Matcher::equal("host", "z")]), Some(vec![]));
        assert_eq!(ids(&[Matcher::equal("rack", "r1")]), Some(vec![]));
        // Matchers that an absent label satisfies cannot use the postings.
        let others = [
            Matcher::not_equal("host", "a"),
            Matcher::equal("rack", ""),
            re("host", "a|"),
        ];
        let (ids, rest) = select(&p, &others);
        assert_eq!(ids, None);
        assert_eq!(rest.len(), 3);
        let gpu_1_not_a = [Matcher::equal("gpu", "1"), others[0].clone()];
        let (ids, rest) = select(&p, &gpu_1_not_a);
        assert_eq!(ids, Some(vec![2, 3]));
        assert_eq!(rest, [&others[0]]);
    }
}
