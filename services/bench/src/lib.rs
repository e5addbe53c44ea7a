//! Load generator and side-by-side mode comparison.
