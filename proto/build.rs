//! Generates the `zerolayer.v1` types and service stubs with `protox` (a pure-Rust
//! protobuf compiler) so that a plain `cargo build` needs no `protoc`.

use std::{env, path::PathBuf};

use prost::Message as _;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["zerolayer/v1/inference.proto"];
    let includes = ["proto"];
    for file in files {
        println!("cargo:rerun-if-changed=proto/{file}");
    }
    let fds = protox::compile(files, includes)?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    // Reflection serves this descriptor set so that `grpcurl` works without .proto files.
    std::fs::write(
        out_dir.join("zerolayer_descriptor.bin"),
        fds.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .emit_rerun_if_changed(false)
        .codec_path("crate::codec::ZerolayerCodec")
        .compile_fds(fds)?;
    Ok(())
}
