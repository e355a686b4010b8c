//! Label postings, (label name, value) -> ascending series ids, and the
//! selection through them that segments and the head share.

use std::collections::HashMap;

use roaring::RoaringBitmap;

use crate::series::{KeyHasher, Matcher, Sym};

/// Label name -> value -> series ids (the metric name under `__name__`), as
/// Roaring bitmaps: a list of a label every series has (model, driver,
/// cluster) costs a bit a series instead of four bytes, a sparse one two
/// bytes an id, a list of consecutive ids (the series of one GPU or host,
/// which arrive together) four bytes a run ([`add`] and a segment's open
/// turn them into run containers), and the intersections of a selector work a
/// container at a time (docs/BENCHMARKS.md has the sizes).
pub(crate) type Postings = HashMap<Sym, HashMap<Sym, RoaringBitmap, KeyHasher>, KeyHasher>;

/// Adds `id`, greater than every id already listed, under `(name, value)`.
/// A new list keeps the strings given: a head passes its keys' shared
/// [`Sym`]s, so that a list of a GPU's UUID costs no copy of it.
pub(crate) fn add(
    postings: &mut Postings,
    name: impl AsRef<str> + Into<Sym>,
    value: impl AsRef<str> + Into<Sym>,
    id: u32,
) {
    let values = match postings.get_mut(name.as_ref()) {
        Some(values) => values,
        None => postings.entry(name.into()).or_default(),
    };
    let ids = match values.get_mut(value.as_ref()) {
        Some(ids) => ids,
        None => values.entry(value.into()).or_default(),
    };
    let pushed = ids.try_push(id);
    debug_assert!(pushed.is_ok(), "postings ids are added in ascending order");
    // Each time a list doubles, it takes the smallest of array, bitmap and
    // runs (a run container grows by extending its last run, and a run of
    // scattered ids would cost 4 bytes an id): the check counts the runs
    // of the list, so it costs O(1) an id over the list's life.
    let n = ids.len();
    if n >= 8 && n.is_power_of_two() {
        ids.optimize();
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
    let mut candidates: Option<RoaringBitmap> = None;
    let mut rest = Vec::new();
    for m in matchers {
        let values = postings.get(m.name());
        let list: RoaringBitmap = match m {
            Matcher::Equal { value, .. } if !value.is_empty() => {
                let Some(ids) = values.and_then(|v| v.get(value.as_str())) else {
                    candidates = Some(RoaringBitmap::new());
                    continue;
                };
                match &mut candidates {
                    // No copy of the list: intersect in place.
                    Some(c) => {
                        *c &= ids;
                        continue;
                    }
                    None => ids.clone(),
                }
            }
            Matcher::Regex { pattern, .. } if !pattern.is_match("") => values
                .into_iter()
                .flatten()
                .filter(|(v, _)| pattern.is_match(v))
                .fold(RoaringBitmap::new(), |mut all, (_, ids)| {
                    all |= ids;
                    all
                }),
            _ => {
                rest.push(m);
                continue;
            }
        };
        candidates = Some(match candidates {
            None => list,
            Some(c) => c & list,
        });
    }
    (candidates.map(|c| c.iter().collect()), rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn postings(series: &[&[(&str, &str)]]) -> Postings {
        let mut p = Postings::default();
        for (id, labels) in series.iter().enumerate() {
            for (n, v) in labels.iter() {
                add(&mut p, *n, *v, id as u32);
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

    /// A list of consecutive ids (a GPU's series) becomes one run; one of
    /// scattered ids (a metric's, every 25th) stays an array; both list
    /// every id added.
    #[test]
    fn consecutive_ids_are_kept_as_runs() {
        let mut p = Postings::default();
        for id in 0..10_000u32 {
            add(&mut p, "UUID", "GPU-0", id);
            if id % 25 == 0 {
                add(&mut p, "__name__", "temp", id);
            }
        }
        let list = |n: &str, v: &str| &p[n][v];
        let (gpu, temp) = (list("UUID", "GPU-0"), list("__name__", "temp"));
        assert_eq!(gpu.len(), 10_000);
        assert!(gpu.iter().eq(0..10_000));
        let s = gpu.statistics();
        assert_eq!((s.n_run_containers, s.n_values_run_containers), (1, 10_000));
        assert!(temp.iter().eq((0..10_000).step_by(25)));
        let s = temp.statistics();
        assert_eq!((s.n_array_containers, s.n_run_containers), (1, 0));
        assert_eq!(s.n_values_array_containers, 400);
    }

    proptest::proptest! {
        /// The postings' picks, filtered by the matchers they leave, are
        /// the series a test of every matcher against every key picks
        /// (ids spread over several Roaring containers).
        #[test]
        fn select_picks_what_testing_every_series_picks(
            series in proptest::collection::vec(
                (0..3usize, proptest::option::of(0..4usize), proptest::option::of(0..3usize)),
                1..200,
            ),
            spread in proptest::sample::select(vec![1u32, 70_001]),
            picks in proptest::collection::vec((0..3usize, 0..5usize), 0..4),
        ) {
            use crate::series::{Label, SeriesKey};
            let keys: Vec<SeriesKey> = series
                .iter()
                .map(|&(metric, host, gpu)| {
                    let mut labels = Vec::new();
                    labels.extend(host.map(|h| Label::new("host", format!("h{h}"))));
                    labels.extend(gpu.map(|g| Label::new("gpu", g.to_string())));
                    SeriesKey::new(format!("m{metric}"), labels).unwrap()
                })
                .collect();
            let mut p = Postings::default();
            for (i, k) in keys.iter().enumerate() {
                let id = i as u32 * spread;
                add(&mut p, crate::series::METRIC_NAME_LABEL, k.metric(), id);
                for l in k.labels() {
                    add(&mut p, &l.name, &l.value, id);
                }
            }
            let matchers: Vec<Matcher> = picks
                .iter()
                .map(|&(name, kind)| {
                    let name = ["__name__", "host", "gpu"][name];
                    match kind {
                        0 => Matcher::equal(name, "h1"),
                        1 => Matcher::equal(name, "m0"),
                        2 => Matcher::equal(name, "1"),
                        3 => Matcher::regex(name, "h[02]|m1|2").unwrap(),
                        _ => Matcher::not_equal(name, "h0"),
                    }
                })
                .collect();
            let want: Vec<u32> = (0..keys.len())
                .filter(|&i| matchers.iter().all(|m| m.matches(&keys[i])))
                .map(|i| i as u32 * spread)
                .collect();
            let (picked, rest) = select(&p, &matchers);
            let all: Vec<u32> = (0..keys.len() as u32).map(|i| i * spread).collect();
            let got: Vec<u32> = picked
                .unwrap_or(all)
                .into_iter()
                .filter(|&id| rest.iter().all(|m| m.matches(&keys[(id / spread) as usize])))
                .collect();
            proptest::prop_assert_eq!(got, want);
        }
    }
}
