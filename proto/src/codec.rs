//! The codec of every generated zerolayer client and server: prost encoding, with malformed
//! requests reported as `INVALID_ARGUMENT` + reason `INVALID_REQUEST` (a client error)
//! instead of prost's default `INTERNAL` (which would blame the server).

use std::marker::PhantomData;

use prost::Message;
use tonic::{
    Status,
    codec::{BufferSettings, Codec, DecodeBuf, Decoder},
    metadata::MetadataValue,
};
use tonic_prost::{ProstDecoder, ProstEncoder};

use crate::ERROR_REASON_METADATA;

/// A status for bytes that do not decode as the expected message.
pub fn malformed(error: impl std::fmt::Display) -> Status {
    let mut status = Status::invalid_argument(format!("malformed protobuf message: {error}"));
    status.metadata_mut().insert(
        ERROR_REASON_METADATA,
        MetadataValue::from_static("INVALID_REQUEST"),
    );
    status
}

/// Codec used by the generated stubs (see build.rs `codec_path`).
#[derive(Debug, Clone, Copy)]
pub struct ZerolayerCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for ZerolayerCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

/// Decoder half of [`ZerolayerCodec`].
#[derive(Debug, Default)]
pub struct ZerolayerDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default> Decoder for ZerolayerDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|s| {
            if s.code() == tonic::Code::Internal {
                malformed(s.message())
            } else {
                s
            }
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

impl<T, U> Codec for ZerolayerCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ZerolayerDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ZerolayerDecoder(ProstDecoder::new(BufferSettings::default()))
    }
}

/// Re-exported so the encoder type can be named.
pub type ZerolayerEncoder<T> = ProstEncoder<T>;
