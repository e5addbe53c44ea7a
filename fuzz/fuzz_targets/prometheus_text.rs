//! Fuzzes the Prometheus text parser of `zerolayer bench` (`zerolayer_bench::prom::parse`),
//! which reads `/metrics` pages from the network: it must never panic, and whatever it accepts
//! must be consistent (valid names, one value per sample).

#![no_main]

use libfuzzer_sys::fuzz_target;
use zerolayer_bench::prom::{PromError, counters, parse};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match parse(&text) {
        Ok(samples) => {
            for s in &samples {
                assert!(!s.name.is_empty());
                assert!(
                    s.name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
                );
            }
            let _ = counters(&samples);
        }
        Err(
            PromError::MissingValue { .. }
            | PromError::BadValue { .. }
            | PromError::BadName { .. }
            | PromError::BadLabels { .. }
            | PromError::TooLong { .. },
        ) => {}
    }
});
