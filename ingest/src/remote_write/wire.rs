//! A zero-allocation reader of decompressed remote-write bodies
//! (`prometheus.WriteRequest`), for the write path's hot loop.
//!
//! Prometheus sends one `TimeSeries` per sample, with the whole label set
//! each time, so decoding every request into owned strings costs two
//! allocations per label per sample. This reader instead hands out each
//! series' label fields as raw bytes (the key of the series cache in
//! `remote_write.rs`) and its samples as numbers; labels are decoded, and
//! validated, only for a series the cache has not seen ([`labels`]). The fuzz
//! target `remote_request` checks it against prost's decoding.

use std::ops::Range;

/// One `TimeSeries` of a request: its label fields, in their wire encoding
/// (field 1 of `TimeSeries`, tag and length included), and its samples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawSeries {
    /// Into [`RawWrite::label_bytes`].
    pub labels: Range<usize>,
    /// Into [`RawWrite::timestamps`] and [`RawWrite::values`].
    pub samples: Range<usize>,
    /// The series carries native histograms (field 4).
    pub histograms: bool,
}

/// A decoded request; reused across requests to keep its buffers.
#[derive(Debug, Default, Clone)]
pub struct RawWrite {
    pub series: Vec<RawSeries>,
    pub label_bytes: Vec<u8>,
    pub timestamps: Vec<i64>,
    pub values: Vec<f64>,
}

/// Why a body is not a `WriteRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError(pub String);

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn done(&self) -> bool {
        self.pos >= self.buf.len()
    }

    fn varint(&mut self) -> Result<u64, WireError> {
        let mut v = 0u64;
        for shift in (0..70).step_by(7) {
            let Some(&b) = self.buf.get(self.pos) else {
                return Err(WireError("truncated varint".into()));
            };
            self.pos += 1;
            if shift == 63 && b > 1 {
                return Err(WireError("varint overflows 64 bits".into()));
            }
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Ok(v);
            }
        }
        Err(WireError("varint longer than 10 bytes".into()))
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], WireError> {
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| self.pos.checked_add(n))
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| WireError(format!("a field of {n} bytes runs past the end")))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    /// `(field number, wire type)`.
    fn key(&mut self) -> Result<(u64, u8), WireError> {
        let k = self.varint()?;
        if k > u64::from(u32::MAX) {
            return Err(WireError(format!("invalid field key {k}")));
        }
        let field = k >> 3;
        if field == 0 {
            return Err(WireError("field number 0".into()));
        }
        Ok((field, (k & 7) as u8))
    }

    /// Skips a field the reader does not use, as prost skips unknown fields
    /// (groups included).
    fn skip(&mut self, field: u64, wire: u8) -> Result<(), WireError> {
        self.skip_nested(wire, field, 0)
    }

    fn skip_nested(&mut self, wire: u8, field: u64, depth: u32) -> Result<(), WireError> {
        match wire {
            0 => self.varint().map(drop),
            1 => self.take(8).map(drop),
            2 => {
                let n = self.varint()?;
                self.take(n).map(drop)
            }
            3 => {
                if depth >= 1000 {
                    return Err(WireError("groups nested too deeply".into()));
                }
                loop {
                    let (f, w) = self.key()?;
                    if w == 4 {
                        return if f == field {
                            Ok(())
                        } else {
                            Err(WireError("unbalanced end-group tag".into()))
                        };
                    }
                    self.skip_nested(w, f, depth + 1)?;
                }
            }
            5 => self.take(4).map(drop),
            w => Err(WireError(format!("unexpected wire type {w}"))),
        }
    }

    fn bytes(&mut self, wire: u8, what: &str) -> Result<&'a [u8], WireError> {
        if wire != 2 {
            return Err(WireError(format!("{what}: wire type {wire}, expected 2")));
        }
        let n = self.varint()?;
        self.take(n)
    }
}

impl RawWrite {
    /// Reads `body` (a decompressed `WriteRequest`) into `self`, replacing
    /// what was there. Fields it does not use (metadata, exemplars, unknown
    /// fields) are skipped, as prost skips them. The label fields are only
    /// delimited here: [`labels`] decodes and validates them, so a body
    /// prost refuses for a bad label passes here and fails there.
    ///
    /// # Errors
    /// The body is not a valid encoding of a `WriteRequest`.
    pub fn read(&mut self, body: &[u8]) -> Result<(), WireError> {
        self.series.clear();
        self.label_bytes.clear();
        self.timestamps.clear();
        self.values.clear();
        let mut r = Reader { buf: body, pos: 0 };
        while !r.done() {
            let (field, wire) = r.key()?;
            if field == 1 {
                let ts = r.bytes(wire, "WriteRequest.timeseries")?;
                self.read_series(ts)?;
            } else {
                r.skip(field, wire)?;
            }
        }
        Ok(())
    }

    fn read_series(&mut self, body: &[u8]) -> Result<(), WireError> {
        let (l0, s0) = (self.label_bytes.len(), self.timestamps.len());
        let mut histograms = false;
        let mut r = Reader { buf: body, pos: 0 };
        while !r.done() {
            let start = r.pos;
            let (field, wire) = r.key()?;
            match field {
                1 => {
                    // Decoded and validated (UTF-8, structure) by [`labels`],
                    // once per distinct label set, by the caller.
                    r.bytes(wire, "TimeSeries.labels")?;
                    self.label_bytes.extend_from_slice(&body[start..r.pos]);
                }
                2 => {
                    let s = r.bytes(wire, "TimeSeries.samples")?;
                    let (t, v) = read_sample(s)?;
                    self.timestamps.push(t);
                    self.values.push(v);
                }
                4 => {
                    r.bytes(wire, "TimeSeries.histograms")?;
                    histograms = true;
                }
                _ => r.skip(field, wire)?,
            }
        }
        self.series.push(RawSeries {
            labels: l0..self.label_bytes.len(),
            samples: s0..self.timestamps.len(),
            histograms,
        });
        Ok(())
    }
}

fn read_sample(body: &[u8]) -> Result<(i64, f64), WireError> {
    let (mut t, mut v) = (0i64, 0f64);
    let mut r = Reader { buf: body, pos: 0 };
    while !r.done() {
        let (field, wire) = r.key()?;
        match (field, wire) {
            (1, 1) => {
                let b = r.take(8)?;
                v = f64::from_le_bytes(b.try_into().expect("BUG: took 8 bytes"));
            }
            (2, 0) => t = r.varint()? as i64,
            (1 | 2, w) => return Err(WireError(format!("Sample field {field}: wire type {w}"))),
            _ => r.skip(field, wire)?,
        }
    }
    Ok((t, v))
}

/// The labels of [`RawSeries::labels`] as `(name, value)` pairs, in wire
/// order. Only for bytes [`RawWrite::read`] accepted.
pub fn labels(bytes: &[u8]) -> Result<Vec<(String, String)>, WireError> {
    let mut out = Vec::new();
    let mut r = Reader { buf: bytes, pos: 0 };
    while !r.done() {
        let (_, wire) = r.key()?;
        let label = r.bytes(wire, "TimeSeries.labels")?;
        let (mut name, mut value) = (String::new(), String::new());
        let mut l = Reader { buf: label, pos: 0 };
        while !l.done() {
            let (field, wire) = l.key()?;
            match field {
                1 | 2 => {
                    let s = std::str::from_utf8(l.bytes(wire, "Label")?)
                        .map_err(|_| WireError("a label is not UTF-8".into()))?;
                    if field == 1 { &mut name } else { &mut value }.replace_range(.., s);
                }
                _ => l.skip(field, wire)?,
            }
        }
        out.push((name, value));
    }
    Ok(out)
}
