//! Signed context handles: fixed-size binary format, issue, verify, renew, keys.
