//! Fuzzes the model file parsers with arbitrary bytes: the llama2.c checkpoint reader and the
//! llama2.c tokenizer reader (then encoding/decoding with any tokenizer that parses). Neither may
//! panic or allocate beyond what the input justifies.
#![no_main]

use libfuzzer_sys::fuzz_target;
use zerolayer_model::Tokenizer;
use zerolayer_model::llama2c::parse_checkpoint;

fuzz_target!(|data: &[u8]| {
    let _ = parse_checkpoint(data);
    // First two bytes pick a vocabulary size around the byte-fallback minimum of 259.
    if data.len() >= 2 {
        let vocab = 250 + u16::from_le_bytes([data[0], data[1]]) as usize % 300;
        if let Ok(tok) = Tokenizer::from_llama2c_bytes(&data[2..], vocab) {
            let ids = tok.encode("fuzz <0x41> \u{00e9}\u{1F600}", true, true);
            let _ = tok.decode(&ids);
        }
    }
});
