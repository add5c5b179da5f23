//! `ShouldRateLimit` as it comes off the wire, with its strings read as bytes. Why: a descriptor's
//! value is whatever a client put in a header (an API key), and Envoy sends bytes that are not
//! UTF-8 as they are. The generated server decodes strings strictly, and failed the whole call
//! (`INTERNAL`) on one such byte: Envoy then let the request through (`failure_mode_deny: false`,
//! its default) with none of its limits applied. Here such text is escaped instead, one to one,
//! so the value selects its own account like any other.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::num::NonZeroUsize;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use prost::bytes::Buf;
use prost::Message;
use tokio::sync::Semaphore;
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::codegen::{http, BoxFuture, Context, Poll, Service, StdError};
use tonic::{Request, Response, Status};

use super::service::RateLimitServer;

/// The one method's path.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// `RateLimitRequest`, its strings as bytes (the same wire form).
#[derive(Clone, PartialEq, Message)]
pub struct WireRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub domain: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<WireDescriptor>,
    #[prost(uint32, tag = "3")]
    pub hits_addend: u32,
}

/// `RateLimitDescriptor`, its entries' strings as bytes.
#[derive(Clone, PartialEq, Message)]
pub struct WireDescriptor {
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<WireEntry>,
    #[prost(message, optional, tag = "2")]
    pub limit: Option<RateLimitOverride>,
    #[prost(message, optional, tag = "3")]
    pub hits_addend: Option<UInt64Value>,
    #[prost(bool, tag = "4")]
    pub is_negative_hits: bool,
}

/// `RateLimitDescriptor.Entry`, as bytes.
#[derive(Clone, PartialEq, Message)]
pub struct WireEntry {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

impl From<WireRequest> for RateLimitRequest {
    fn from(wire: WireRequest) -> Self {
        let descriptor = |d: WireDescriptor| RateLimitDescriptor {
            entries: d
                .entries
                .into_iter()
                .map(|e| Entry {
                    key: text(e.key),
                    value: text(e.value),
                })
                .collect(),
            limit: d.limit,
            hits_addend: d.hits_addend,
            is_negative_hits: d.is_negative_hits,
        };
        RateLimitRequest {
            domain: text(wire.domain),
            descriptors: wire.descriptors.into_iter().map(descriptor).collect(),
            hits_addend: wire.hits_addend,
        }
    }
}

/// What [`text`] marks an escape with (and doubles where the text has it).
const MARK: char = char::REPLACEMENT_CHARACTER;

/// `bytes` as text, one to one: UTF-8 as it is, but each byte of an invalid sequence as U+FFFD
/// and its two hex digits, and each U+FFFD of the text doubled, so that two byte strings never
/// read as the same text (a value's text names its caller's account).
pub fn text(bytes: Vec<u8>) -> String {
    // The common case, UTF-8 without the mark, is the text as it came.
    let bytes = match String::from_utf8(bytes) {
        Ok(text) if !text.contains(MARK) => return text,
        Ok(text) => text.into_bytes(),
        Err(error) => error.into_bytes(),
    };
    // Its exact length, so that a message of invalid bytes is not held at up to twice its text
    // (a growing string doubles).
    let length = text_length(&bytes);
    let mut text = String::with_capacity(length);
    for chunk in bytes.utf8_chunks() {
        text.push_str(&chunk.valid().replace(MARK, "\u{FFFD}\u{FFFD}"));
        for byte in chunk.invalid() {
            let _ = write!(text, "{MARK}{byte:02x}");
        }
    }
    debug_assert_eq!(text.len(), length);
    text
}

/// The length of [`text`]`(bytes)`: up to five times theirs (an invalid byte is U+FFFD and two
/// hex digits).
fn text_length(bytes: &[u8]) -> usize {
    (bytes.utf8_chunks())
        .map(|chunk| {
            let marks = chunk.valid().matches(MARK).count();
            chunk.valid().len()
                + marks * MARK.len_utf8()
                + chunk.invalid().len() * (MARK.len_utf8() + 2)
        })
        .sum()
}

impl WireRequest {
    /// The bytes of its strings once read as text ([`text`]).
    fn text_length(&self) -> usize {
        let entries = self.descriptors.iter().flat_map(|d| &d.entries);
        let entries: usize = entries
            .map(|e| text_length(&e.key) + text_length(&e.value))
            .sum();
        text_length(&self.domain) + entries
    }
}

/// Decodes [`WireRequest`]s into `RateLimitRequest`s; encodes responses as prost does.
#[derive(Clone, Copy, Default)]
struct WireCodec;

struct WireDecoder;

impl Decoder for WireDecoder {
    type Item = RateLimitRequest;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<RateLimitRequest>, Status> {
        // The whole message: tonic's buffer is one `BytesMut`, a single chunk.
        debug_assert_eq!(buf.chunk().len(), buf.remaining());
        bounded(buf.chunk())?;
        let wire = WireRequest::decode(buf).map_err(|error| {
            Status::invalid_argument(format!("not a RateLimitRequest: {error}"))
        })?;
        // Escaped, a message's text may be five times its size, and each call in flight holds
        // it: the bound on calls bounds their memory only if the text's size is bounded too.
        if wire.text_length() > super::REQUEST_BYTES_MAX {
            return Err(Status::invalid_argument(format!(
                "the request's strings are over {} bytes once their bytes that are not UTF-8 are \
                 escaped",
                super::REQUEST_BYTES_MAX
            )));
        }
        Ok(Some(wire.into()))
    }
}

/// Descriptors one request may carry (as the service allows), and entries one descriptor may
/// (Envoy's actions make them; no client adds one), counted on the wire before anything is
/// decoded. Why: each message costs its decoded size, not its bytes: a megabyte of empty entries
/// decodes to about half a million, tens of megabytes per call. Bytes that are no protobuf are
/// left to the decoder to refuse.
const ENTRIES_PER_DESCRIPTOR_MAX: usize = 256;

fn bounded(message: &[u8]) -> Result<(), Status> {
    use super::service::DESCRIPTORS_MAX;
    let mut descriptors = 0;
    let too_many = |what: String| Err(Status::invalid_argument(what));
    for field in fields(message) {
        let Field::Delimited(2, value) = field? else {
            continue;
        };
        descriptors += 1;
        if descriptors > DESCRIPTORS_MAX {
            return too_many(format!("at most {DESCRIPTORS_MAX} descriptors per request"));
        }
        let mut entries = 0;
        for field in fields(value) {
            if let Field::Delimited(1, _) = field? {
                entries += 1;
            }
        }
        if entries > ENTRIES_PER_DESCRIPTOR_MAX {
            return too_many(format!(
                "at most {ENTRIES_PER_DESCRIPTOR_MAX} entries per descriptor"
            ));
        }
    }
    Ok(())
}

/// A field [`fields`] reads: length-delimited, as (field number, bytes), or numeric.
enum Field<'a> {
    Delimited(u64, &'a [u8]),
    Numeric,
}

/// The fields of a protobuf message. Ends early at anything malformed, which the decoder
/// refuses. A group (wire types 3 and 4) is refused here: proto3 has none, and the decoder would
/// skip it and decode what follows, which this count would not have seen (descriptors or entries
/// past any bound, behind two bytes).
fn fields(mut message: &[u8]) -> impl Iterator<Item = Result<Field<'_>, Status>> {
    use prost::encoding::decode_varint;
    std::iter::from_fn(move || {
        let tag = decode_varint(&mut message).ok()?;
        let skip = match tag & 7 {
            0 => {
                decode_varint(&mut message).ok()?;
                0
            }
            1 => 8,
            2 => {
                let length = usize::try_from(decode_varint(&mut message).ok()?).ok()?;
                let value = message.get(..length)?;
                message = &message[length..];
                return Some(Ok(Field::Delimited(tag >> 3, value)));
            }
            5 => 4,
            3 | 4 => {
                let group = "a protobuf group: not a RateLimitRequest (proto3 has none)";
                return Some(Err(Status::invalid_argument(group)));
            }
            _ => return None,
        };
        message = message.get(skip..)?;
        Some(Ok(Field::Numeric))
    })
}

impl Codec for WireCodec {
    type Encode = RateLimitResponse;
    type Decode = RateLimitRequest;
    type Encoder = tonic_prost::ProstEncoder<RateLimitResponse>;
    type Decoder = WireDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        WireDecoder
    }
}

/// The `RateLimitService` gRPC service over [`RateLimitServer`], as the generated server serves
/// it but for the request's decoding, with at most `calls_max` calls at once. A call holds its
/// place from its headers on, its message's arrival included: a peer that sends headers and no
/// message holds places until the call's bound (the decision's deadline and a second), which
/// Envoy's calls never do (the message follows its headers at once); the port is Envoy's alone
/// (README, "Who may call it").
#[derive(Clone)]
pub struct WireServer {
    inner: Arc<RateLimitServer>,
    request_bytes_max: usize,
    /// A place per call in flight, held until its answer is made.
    calls: Arc<Semaphore>,
}

impl WireServer {
    pub fn new(server: RateLimitServer, request_bytes_max: usize, calls_max: NonZeroUsize) -> Self {
        WireServer {
            inner: Arc::new(server),
            request_bytes_max,
            calls: Arc::new(Semaphore::new(calls_max.get())),
        }
    }
}

/// An empty `RateLimitRequest` as a gRPC message (uncompressed, 0 bytes long): what a call past
/// the bound is read as, its own body left unread.
const EMPTY_REQUEST: &str = "\0\0\0\0\0";

/// A call past the bound: answered under the failure policy, without a decision.
struct Shed(Arc<RateLimitServer>);

impl tonic::server::UnaryService<RateLimitRequest> for Shed {
    type Response = RateLimitResponse;
    type Future = BoxFuture<Response<RateLimitResponse>, Status>;

    fn call(&mut self, _: Request<RateLimitRequest>) -> Self::Future {
        let answer = self.0.shed();
        Box::pin(async move { answer })
    }
}

impl tonic::server::NamedService for WireServer {
    const NAME: &'static str = "envoy.service.ratelimit.v3.RateLimitService";
}

struct ShouldRateLimit(Arc<RateLimitServer>);

impl tonic::server::UnaryService<RateLimitRequest> for ShouldRateLimit {
    type Response = RateLimitResponse;
    type Future = BoxFuture<Response<RateLimitResponse>, Status>;

    fn call(&mut self, request: Request<RateLimitRequest>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move { inner.should_rate_limit(request).await })
    }
}

impl<B> Service<http::Request<B>> for WireServer
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != SHOULD_RATE_LIMIT {
            return Box::pin(async { Ok(Status::unimplemented("").into_http()) });
        }
        let inner = self.inner.clone();
        // Past the bound, the call's body is never read: it costs its headers alone, where it
        // could have held up to `request_bytes_max` for as long as its deadline.
        let Ok(place) = self.calls.clone().try_acquire_owned() else {
            let empty = request.map(|_| String::from(EMPTY_REQUEST));
            return Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(WireCodec);
                Ok(grpc.unary(Shed(inner), empty).await)
            });
        };
        let bytes_max = self.request_bytes_max;
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(WireCodec)
                .apply_max_message_size_config(Some(bytes_max), None);
            let answer = grpc.unary(ShouldRateLimit(inner), request).await;
            drop(place);
            Ok(answer)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_and_entries_are_bounded_before_decoding() {
        let entry = WireEntry {
            key: b"k".to_vec(),
            value: b"v".to_vec(),
        };
        let descriptor = |entries: usize| WireDescriptor {
            entries: vec![entry.clone(); entries],
            limit: None,
            hits_addend: Some(UInt64Value { value: 3 }),
            is_negative_hits: true,
        };
        let request = |descriptors: Vec<WireDescriptor>| {
            WireRequest {
                domain: b"d".to_vec(),
                descriptors,
                hits_addend: 7,
            }
            .encode_to_vec()
        };
        let max = super::super::service::DESCRIPTORS_MAX;
        assert!(bounded(&request(vec![descriptor(2); max])).is_ok());
        assert!(bounded(&request(vec![descriptor(ENTRIES_PER_DESCRIPTOR_MAX)])).is_ok());
        let many = bounded(&request(vec![descriptor(0); max + 1])).unwrap_err();
        assert_eq!(many.code(), tonic::Code::InvalidArgument);
        let deep = bounded(&request(vec![descriptor(ENTRIES_PER_DESCRIPTOR_MAX + 1)]));
        assert_eq!(deep.unwrap_err().code(), tonic::Code::InvalidArgument);
        // Not a protobuf: left to the decoder.
        assert!(bounded(&[0xff, 0xff, 0xff]).is_ok());
        assert!(bounded(&[]).is_ok());

        // A group (field 15: start, end), which the decoder skips, hides nothing behind it:
        // descriptors past the bound, or entries past the bound in a descriptor.
        let group = [0x7b, 0x7c];
        let hidden = [&group[..], &request(vec![descriptor(0); max + 1])].concat();
        let decoded = WireRequest::decode(&hidden[..]).expect("the decoder skips groups");
        assert_eq!(decoded.descriptors.len(), max + 1);
        assert_eq!(
            bounded(&hidden).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        let deep = descriptor(ENTRIES_PER_DESCRIPTOR_MAX + 1).encode_to_vec();
        let mut hidden_deep = Vec::new();
        prost::encoding::bytes::encode(2, &[&group[..], &deep].concat(), &mut hidden_deep);
        let decoded = WireRequest::decode(&hidden_deep[..]).expect("the decoder skips groups");
        assert_eq!(
            decoded.descriptors[0].entries.len(),
            ENTRIES_PER_DESCRIPTOR_MAX + 1
        );
        let refused = bounded(&hidden_deep).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn text_is_one_to_one() {
        let cases: [&[u8]; 7] = [
            b"key",
            b"ab\xff",
            b"ab\xfe",
            "ab\u{FFFD}ff".as_bytes(),
            "ab\u{FFFD}".as_bytes(),
            "ab\u{FFFD}\u{FFFD}".as_bytes(),
            b"\xc3",
        ];
        let texts: Vec<String> = cases.iter().map(|c| text(c.to_vec())).collect();
        assert_eq!(texts[0], "key", "UTF-8 without the mark is kept as it is");
        assert_eq!(texts[1], "ab\u{FFFD}ff");
        assert_eq!(texts[3], "ab\u{FFFD}\u{FFFD}ff");
        let distinct: std::collections::HashSet<&String> = texts.iter().collect();
        assert_eq!(distinct.len(), cases.len(), "{texts:?}");
        // Held at its length: a growing string held a message of invalid bytes at up to twice
        // its text (8 MiB for 1 MiB).
        for hostile in [
            vec![0xff; 4096],
            "\u{FFFD}x\u{FFFD}".repeat(500).into_bytes(),
        ] {
            let text = text(hostile);
            assert_eq!(text.capacity(), text.len());
        }
    }

    #[test]
    fn a_request_with_bytes_that_are_not_utf8_decodes() {
        let wire = WireRequest {
            domain: b"edge".to_vec(),
            descriptors: vec![WireDescriptor {
                entries: vec![WireEntry {
                    key: b"api_key".to_vec(),
                    value: b"k\xff".to_vec(),
                }],
                limit: None,
                hits_addend: Some(UInt64Value { value: 3 }),
                is_negative_hits: false,
            }],
            hits_addend: 2,
        };
        let bytes = wire.encode_to_vec();
        assert!(
            RateLimitRequest::decode(bytes.as_slice()).is_err(),
            "the generated type refuses it"
        );
        let request: RateLimitRequest = WireRequest::decode(bytes.as_slice()).unwrap().into();
        assert_eq!(request.domain, "edge");
        assert_eq!(request.hits_addend, 2);
        let descriptor = &request.descriptors[0];
        assert_eq!(descriptor.entries[0].value, "k\u{FFFD}ff");
        assert_eq!(descriptor.hits_addend, Some(UInt64Value { value: 3 }));
    }
}
