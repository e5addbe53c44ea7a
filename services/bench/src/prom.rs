//! Reads the Prometheus `/metrics` page of a zerolayer process: a minimal HTTP/1.0 GET and a
//! parser for the text exposition format (version 0.0.4).
//!
//! The page comes over the network, so the parser treats it as untrusted: bounded size,
//! typed errors, no panics (property-tested here and fuzzed by `fuzz/fuzz_targets/prometheus_text.rs`).

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{TcpStream, ToSocketAddrs},
    time::Duration,
};

/// Largest `/metrics` page read: a zerolayer process exposes about 12 KiB (histograms
/// included); 4 MiB leaves room for any label growth while bounding a hostile server.
pub const MAX_METRICS_BYTES: usize = 4 << 20;

/// Connect and read timeout of a scrape: the page is served from memory on localhost, so
/// 10 s only expires when the process is wedged.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest sample line accepted, in bytes: zerolayer's longest line is under 150 bytes;
/// Prometheus itself has no limit, so this only bounds the parser's work per line.
pub const MAX_LINE_BYTES: usize = 4096;

/// A malformed exposition.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PromError {
    /// A sample line has no value.
    #[error("line {line}: no value")]
    MissingValue {
        /// 1-based line number.
        line: usize,
    },
    /// The value is not a number.
    #[error("line {line}: {text:?} is not a number")]
    BadValue {
        /// 1-based line number.
        line: usize,
        /// The text.
        text: String,
    },
    /// The metric name is empty or has characters outside `[a-zA-Z0-9_:]`.
    #[error("line {line}: bad metric name")]
    BadName {
        /// 1-based line number.
        line: usize,
    },
    /// The label set is not `{name="value",…}`.
    #[error("line {line}: bad label set ({reason})")]
    BadLabels {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// A line is longer than [`MAX_LINE_BYTES`].
    #[error("line {line}: longer than {MAX_LINE_BYTES} bytes")]
    TooLong {
        /// 1-based line number.
        line: usize,
    },
}

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// Connecting, writing or reading failed.
    #[error("scraping {addr}: {source}")]
    Io {
        /// The address.
        addr: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The response is not `HTTP/1.x 200`.
    #[error("scraping {addr}: unexpected response {status:?}")]
    Status {
        /// The address.
        addr: String,
        /// The status line.
        status: String,
    },
    /// The page exceeds [`MAX_METRICS_BYTES`].
    #[error("scraping {addr}: page larger than {MAX_METRICS_BYTES} bytes")]
    TooLarge {
        /// The address.
        addr: String,
    },
    /// The page does not parse.
    #[error("scraping {addr}: {source}")]
    Parse {
        /// The address.
        addr: String,
        /// The cause.
        #[source]
        source: PromError,
    },
}

/// One sample: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct PromSample {
    /// Metric name (with `_total`, `_sum`, `_bucket`, … suffixes as exposed).
    pub name: String,
    /// Labels in page order.
    pub labels: Vec<(String, String)>,
    /// The value.
    pub value: f64,
}

impl PromSample {
    /// The value of label `key`.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// `name{k="v",…}` without the `service` label (processes are told apart elsewhere).
    pub fn series(&self) -> String {
        let labels: Vec<String> = self
            .labels
            .iter()
            .filter(|(k, _)| k != "service")
            .map(|(k, v)| format!("{k}=\"{v}\""))
            .collect();
        if labels.is_empty() {
            self.name.clone()
        } else {
            format!("{}{{{}}}", self.name, labels.join(","))
        }
    }
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with(|c: char| c.is_ascii_digit())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Label pairs in page order.
type Labels = Vec<(String, String)>;

/// Parses `{a="x",b="y"}` (the braces included) from the start of `s`; returns the labels
/// and the rest after `}`.
fn parse_labels(s: &str, line: usize) -> Result<(Labels, &str), PromError> {
    let bad = |reason| PromError::BadLabels { line, reason };
    let mut rest = s.strip_prefix('{').ok_or(bad("missing {"))?;
    let mut labels = Vec::new();
    loop {
        rest = rest.trim_start();
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((labels, r));
        }
        let eq = rest.find('=').ok_or(bad("missing ="))?;
        let key = rest[..eq].trim();
        if !valid_name(key) {
            return Err(bad("bad label name"));
        }
        rest = rest[eq + 1..]
            .trim_start()
            .strip_prefix('"')
            .ok_or(bad("missing opening quote"))?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err(bad("unterminated value")),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    _ => return Err(bad("bad escape")),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.push((key.to_owned(), value));
        rest = rest[end + 1..].trim_start();
        if let Some(r) = rest.strip_prefix(',') {
            rest = r;
        } else if !rest.starts_with('}') {
            return Err(bad("missing , or }"));
        }
    }
}

fn parse_value(s: &str, line: usize) -> Result<f64, PromError> {
    match s {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s.parse().map_err(|_| PromError::BadValue {
            line,
            text: s.chars().take(64).collect(),
        }),
    }
}

/// Parses a text exposition: comments and blank lines are skipped; each other line is
/// `name[{labels}] value [timestamp]`.
pub fn parse(text: &str) -> Result<Vec<PromSample>, PromError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let l = raw.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        if l.len() > MAX_LINE_BYTES {
            return Err(PromError::TooLong { line });
        }
        let name_end = l
            .find(|c: char| c == '{' || c.is_whitespace())
            .unwrap_or(l.len());
        let name = &l[..name_end];
        if !valid_name(name) {
            return Err(PromError::BadName { line });
        }
        let mut rest = &l[name_end..];
        let mut labels = Vec::new();
        if rest.starts_with('{') {
            let (l, r) = parse_labels(rest, line)?;
            labels = l;
            rest = r;
        }
        let mut fields = rest.split_whitespace();
        let value = fields.next().ok_or(PromError::MissingValue { line })?;
        let value = parse_value(value, line)?;
        out.push(PromSample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    Ok(out)
}

/// Fetches `http://<addr>/metrics` (addr is `host:port`, optionally with an `http://`
/// prefix) and parses it.
pub fn scrape(addr: &str) -> Result<Vec<PromSample>, ScrapeError> {
    let host = addr
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .trim_end_matches("/metrics");
    let io = |source| ScrapeError::Io {
        addr: host.to_owned(),
        source,
    };
    let sock = host.to_socket_addrs().map_err(io)?.next().ok_or_else(|| {
        io(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no address",
        ))
    })?;
    let mut stream = TcpStream::connect_timeout(&sock, SCRAPE_TIMEOUT).map_err(io)?;
    stream.set_read_timeout(Some(SCRAPE_TIMEOUT)).map_err(io)?;
    stream.set_write_timeout(Some(SCRAPE_TIMEOUT)).map_err(io)?;
    // HTTP/1.0: the server closes after the response and never uses chunked encoding.
    stream
        .write_all(format!("GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes())
        .map_err(io)?;
    let mut body = Vec::new();
    (&mut stream)
        .take(MAX_METRICS_BYTES as u64 + 1)
        .read_to_end(&mut body)
        .map_err(io)?;
    if body.len() > MAX_METRICS_BYTES {
        return Err(ScrapeError::TooLarge {
            addr: host.to_owned(),
        });
    }
    let text = String::from_utf8_lossy(&body);
    let (head, page) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.lines().next().unwrap_or_default();
    let mut parts = status.split_whitespace();
    if !(parts.next().is_some_and(|v| v.starts_with("HTTP/1.")) && parts.next() == Some("200")) {
        return Err(ScrapeError::Status {
            addr: host.to_owned(),
            status: status.chars().take(80).collect(),
        });
    }
    parse(page).map_err(|source| ScrapeError::Parse {
        addr: host.to_owned(),
        source,
    })
}

/// Counter-like series (`*_total`, `*_sum`, `*_count`; histogram buckets left out) as a map
/// from [`PromSample::series`] to value.
pub fn counters(samples: &[PromSample]) -> BTreeMap<String, f64> {
    samples
        .iter()
        .filter(|s| {
            s.name.ends_with("_total") || s.name.ends_with("_sum") || s.name.ends_with("_count")
        })
        .map(|s| (s.series(), s.value))
        .collect()
}

/// `after - before` per series (series missing before count from 0: label sets appear on
/// first use).
pub fn delta(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const PAGE: &str = r#"# HELP zerolayer_handle_verify_total Handle verifications.
# TYPE zerolayer_handle_verify_total counter
zerolayer_handle_verify_total{service="collapsed",path="fast_path"} 12
zerolayer_handle_verify_total{service="collapsed",path="full_verify"} 3
zerolayer_slot_evictions_total{service="collapsed"} 0
zerolayer_time_to_first_token_seconds_bucket{service="front",le="+Inf"} 7
zerolayer_step_seconds_total 1.5e-3 1700000000
odd{a="x\"y\\z\n",b = "", } NaN
"#;

    #[test]
    fn a_zerolayer_page_parses_into_series_and_values() {
        let s = parse(PAGE).unwrap();
        assert_eq!(s.len(), 6);
        assert_eq!(s[0].name, "zerolayer_handle_verify_total");
        assert_eq!(s[0].label("path"), Some("fast_path"));
        assert_eq!(s[0].value, 12.0);
        assert_eq!(
            s[0].series(),
            r#"zerolayer_handle_verify_total{path="fast_path"}"#
        );
        assert_eq!(s[3].label("le"), Some("+Inf"));
        assert_eq!(s[4].value, 1.5e-3);
        assert_eq!(s[5].label("a"), Some("x\"y\\z\n"));
        assert_eq!(s[5].label("b"), Some(""));
        assert!(s[5].value.is_nan());
        let c = counters(&s);
        assert_eq!(c.len(), 4, "buckets and gauges are left out: {c:?}");
    }

    #[test]
    fn malformed_lines_get_typed_errors_with_line_numbers() {
        assert_eq!(parse("a 1\nb"), Err(PromError::MissingValue { line: 2 }));
        assert!(matches!(
            parse("a x"),
            Err(PromError::BadValue { line: 1, .. })
        ));
        assert_eq!(parse("9a 1"), Err(PromError::BadName { line: 1 }));
        assert!(matches!(
            parse("a{b=c} 1"),
            Err(PromError::BadLabels { .. })
        ));
        assert!(matches!(
            parse("a{b=\"c} 1"),
            Err(PromError::BadLabels { .. })
        ));
        assert!(matches!(
            parse("a{b=\"c\\q\"} 1"),
            Err(PromError::BadLabels {
                reason: "bad escape",
                ..
            })
        ));
        let long = format!("a{{b=\"{}\"}} 1", "x".repeat(MAX_LINE_BYTES + 10));
        assert_eq!(parse(&long), Err(PromError::TooLong { line: 1 }));
    }

    #[test]
    fn deltas_count_new_series_from_zero() {
        let before = BTreeMap::from([("a".to_owned(), 2.0)]);
        let after = BTreeMap::from([("a".to_owned(), 5.0), ("b".to_owned(), 1.0)]);
        let d = delta(&before, &after);
        assert_eq!(d["a"], 3.0);
        assert_eq!(d["b"], 1.0);
    }

    #[test]
    fn scraping_a_closed_port_fails_with_an_io_error() {
        // Bind then drop: the port is (almost certainly) closed right after.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert!(matches!(
            scrape(&addr.to_string()),
            Err(ScrapeError::Io { .. })
        ));
    }

    #[test]
    fn scraping_reads_the_body_of_a_200_and_rejects_other_statuses() {
        for (status, ok) in [("200 OK", true), ("404 Not Found", false)] {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let server = std::thread::spawn(move || {
                let (mut s, _) = listener.accept().unwrap();
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).unwrap();
                write!(
                    s,
                    "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\n\r\nx_total 4\n"
                )
                .unwrap();
            });
            let r = scrape(&format!("http://{addr}"));
            server.join().unwrap();
            match (r, ok) {
                (Ok(s), true) => assert_eq!(s[0].value, 4.0),
                (Err(ScrapeError::Status { .. }), false) => {}
                (r, _) => panic!("unexpected {r:?} for {status}"),
            }
        }
    }

    proptest! {
        #[test]
        fn the_parser_never_panics_on_arbitrary_text(s in "\\PC{0,200}") {
            let _ = parse(&s);
        }

        #[test]
        fn the_parser_never_panics_on_near_valid_lines(
            name in "[a-z_]{1,12}",
            key in "[a-z]{1,6}",
            value in "[ -~]{0,12}",
            num in "[-+0-9.eE]{0,8}|NaN|\\+Inf",
        ) {
            let _ = parse(&format!("{name}{{{key}=\"{value}\"}} {num}"));
        }

        #[test]
        fn well_formed_series_round_trip(
            name in "[a-z_][a-z0-9_]{0,20}",
            labels in proptest::collection::vec(("[a-z][a-z_]{0,8}", "[ -~]{0,16}"), 0..4),
            value in -1e12f64..1e12,
        ) {
            let escaped: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")))
                .collect();
            let line = if labels.is_empty() {
                format!("{name} {value}")
            } else {
                format!("{name}{{{}}} {value}", escaped.join(","))
            };
            let parsed = parse(&line).unwrap();
            prop_assert_eq!(parsed.len(), 1);
            prop_assert_eq!(&parsed[0].name, &name);
            prop_assert_eq!(&parsed[0].labels, &labels);
            prop_assert_eq!(parsed[0].value, value);
        }
    }
}
