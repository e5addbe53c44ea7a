//! A gRPC codec that keeps protobuf bytes as they are.
//!
//! The front decodes each request once (it validates and rate-limits it) but forwards the
//! client's original bytes to the engine, and it writes the engine's already-encoded stream
//! chunks to the client without decoding or re-encoding them.

use std::marker::PhantomData;

use bytes::{Buf, BufMut, Bytes};
use prost::Message;
use tonic::{
    Status,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
};

/// A request decoded for inspection, with the exact bytes the client sent.
#[derive(Debug, Clone)]
pub struct Raw<T> {
    /// The bytes as received (forwarded unchanged).
    pub bytes: Bytes,
    /// The decoded message (for validation and limits only).
    pub message: T,
}

/// A message that is already protobuf-encoded (an engine stream chunk).
#[derive(Debug, Clone)]
pub struct PreEncoded(pub Bytes);

/// An ordinary message encoded with prost.
#[derive(Debug, Clone)]
pub struct Proto<T>(pub T);

/// Writing a response message.
pub trait WireEncode: Send + 'static {
    /// Appends the encoded message.
    fn write(self, dst: &mut EncodeBuf<'_>);
}

impl WireEncode for PreEncoded {
    fn write(self, dst: &mut EncodeBuf<'_>) {
        dst.put_slice(&self.0);
    }
}

impl<T: Message + Send + 'static> WireEncode for Proto<T> {
    fn write(self, dst: &mut EncodeBuf<'_>) {
        // Encoding into a growable buffer cannot run out of space.
        let _ = self.0.encode(dst);
    }
}

/// Reading a request message.
pub trait WireDecode: Sized + Send + 'static {
    /// Decodes the whole message in `src`.
    fn read(src: &mut DecodeBuf<'_>) -> Result<Self, Status>;
}

impl<T: Message + Default + Send + 'static> WireDecode for Raw<T> {
    fn read(src: &mut DecodeBuf<'_>) -> Result<Self, Status> {
        let bytes = src.copy_to_bytes(src.remaining());
        let message = T::decode(bytes.clone()).map_err(zerolayer_proto::codec::malformed)?;
        Ok(Self { bytes, message })
    }
}

/// Codec encoding `E` and decoding `D`.
#[derive(Debug)]
pub struct RawCodec<E, D>(PhantomData<fn() -> (E, D)>);

impl<E, D> Default for RawCodec<E, D> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

/// Encoder half of [`RawCodec`].
#[derive(Debug)]
pub struct RawEncoder<E>(PhantomData<fn() -> E>);

/// Decoder half of [`RawCodec`].
#[derive(Debug)]
pub struct RawDecoder<D>(PhantomData<fn() -> D>);

impl<E: WireEncode> Encoder for RawEncoder<E> {
    type Item = E;
    type Error = Status;

    fn encode(&mut self, item: E, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.write(dst);
        Ok(())
    }
}

impl<D: WireDecode> Decoder for RawDecoder<D> {
    type Item = D;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<D>, Status> {
        D::read(src).map(Some)
    }
}

impl<E: WireEncode, D: WireDecode> Codec for RawCodec<E, D> {
    type Encode = E;
    type Decode = D;
    type Encoder = RawEncoder<E>;
    type Decoder = RawDecoder<D>;

    fn encoder(&mut self) -> Self::Encoder {
        RawEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawDecoder(PhantomData)
    }
}
