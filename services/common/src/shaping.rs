//! Per-request stream shaping (`stream_options`): chunk size limit, minimum spacing and
//! coarser chunks for high-RTT clients.
//!
//! Rules, for one stream:
//! - The effective spacing is `max(min_delay_ms, network_rtt_ms / 2)`: a client that waits a
//!   whole round trip per chunk gains nothing from chunks closer than half of it.
//! - The first chunk leaves as soon as it has text (time to first token is not delayed);
//!   every later chunk leaves no sooner than `spacing` after the previous one, carrying
//!   everything generated meanwhile.
//! - No chunk carries more than `max_buffer_size` bytes of text (0 = no limit). Text is split
//!   at UTF-8 character boundaries; a limit below one character's length still sends one
//!   character per chunk.
//! - Token ids travel with the chunk that holds the end of their text; each chunk's context
//!   update is that of its last token.
//! - The final chunk obeys the same rules and carries `final`.
//!
//! [`Shaper`] is the pure state machine (tested without a clock); [`shape`] drives it with
//! tokio timers.

use std::{collections::VecDeque, time::Duration};

use futures::{Stream, StreamExt};
use tokio::time::Instant;
use zerolayer_engine::api::{ContextState, Event, FinalInfo};
use zerolayer_proto::v1;

use crate::convert::{context_update, final_info};

/// Effective shaping of one stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShapeOptions {
    /// Text bytes per chunk at most; 0 = unlimited.
    pub max_buffer_size: usize,
    /// Minimum spacing between chunks.
    pub spacing: Duration,
}

impl ShapeOptions {
    /// Effective options of a request's `stream_options`.
    pub fn from_proto(opts: Option<&v1::StreamOptions>) -> Self {
        let Some(o) = opts else {
            return Self::default();
        };
        let spacing_ms = o.min_delay_ms.max(o.network_rtt_ms / 2);
        Self {
            max_buffer_size: o.max_buffer_size as usize,
            spacing: Duration::from_millis(u64::from(spacing_ms)),
        }
    }

    /// True when the stream passes through unchanged (one chunk per event).
    pub fn is_passthrough(&self) -> bool {
        self.max_buffer_size == 0 && self.spacing.is_zero()
    }
}

/// A token waiting to be sent: its id, where its text ends in the pending text, and the
/// context after it.
#[derive(Debug, Clone, Copy)]
struct PendingToken {
    id: u32,
    text_end: usize,
    context: ContextState,
}

/// The shaping state machine of one stream.
#[derive(Debug)]
pub struct Shaper {
    opts: ShapeOptions,
    text: String,
    tokens: VecDeque<PendingToken>,
    context: ContextState,
    last_emit: Option<Instant>,
    final_info: Option<FinalInfo>,
    final_sent: bool,
}

impl Shaper {
    /// A shaper for one stream.
    pub fn new(opts: ShapeOptions) -> Self {
        Self {
            opts,
            text: String::new(),
            tokens: VecDeque::new(),
            context: ContextState::default(),
            last_emit: None,
            final_info: None,
            final_sent: false,
        }
    }

    /// Adds an engine event.
    pub fn push(&mut self, event: Event) {
        match event {
            Event::Tokens {
                text,
                token_ids,
                context,
            } => {
                self.text.push_str(&text);
                let end = self.text.len();
                self.tokens
                    .extend(token_ids.into_iter().map(|id| PendingToken {
                        id,
                        text_end: end,
                        context,
                    }));
                self.context = context;
            }
            Event::Finished(f) => {
                self.context = f.context;
                self.final_info = Some(f);
            }
        }
    }

    /// When the next chunk may leave, if one is waiting: `None` = nothing to send.
    pub fn next_deadline(&self) -> Option<Instant> {
        if self.text.is_empty() && self.tokens.is_empty() && self.final_info.is_none() {
            return None;
        }
        Some(match self.last_emit {
            None => Instant::now(),
            Some(t) => t + self.opts.spacing,
        })
    }

    /// True when the final chunk has been sent.
    pub fn is_done(&self) -> bool {
        self.final_sent
    }

    /// Takes the chunks that may leave at `now` (several only when spacing is zero).
    pub fn take_ready(&mut self, now: Instant) -> Vec<v1::GenerateChunk> {
        let mut out = Vec::new();
        while let Some(deadline) = self.next_deadline() {
            if self.last_emit.is_some() && now < deadline {
                break;
            }
            out.push(self.cut_chunk());
            self.last_emit = Some(now);
            if !self.opts.spacing.is_zero() {
                break;
            }
        }
        out
    }

    /// Cuts the next chunk from the pending text and tokens.
    fn cut_chunk(&mut self) -> v1::GenerateChunk {
        let mut cut = self.text.len();
        if self.opts.max_buffer_size > 0 && cut > self.opts.max_buffer_size {
            cut = self.opts.max_buffer_size;
            while !self.text.is_char_boundary(cut) {
                cut -= 1;
            }
            if cut == 0 {
                // The limit is below the first character's length: send that one character.
                cut = self.text.chars().next().map_or(0, char::len_utf8);
            }
        }
        let text: String = self.text.drain(..cut).collect();
        let mut token_ids = Vec::new();
        let mut context = None;
        while let Some(t) = self.tokens.front() {
            if t.text_end > cut {
                break;
            }
            token_ids.push(t.id);
            context = Some(t.context);
            self.tokens.pop_front();
        }
        for t in &mut self.tokens {
            t.text_end -= cut;
        }
        let is_last = self.text.is_empty() && self.tokens.is_empty();
        let final_info = if is_last {
            self.final_info.take()
        } else {
            None
        };
        self.final_sent |= final_info.is_some();
        let context = match (&final_info, context) {
            (Some(f), _) => f.context,
            (None, Some(c)) => c,
            (None, None) => self.context,
        };
        v1::GenerateChunk {
            text,
            token_ids,
            context: Some(context_update(&context)),
            r#final: final_info.as_ref().map(final_info_proto),
        }
    }
}

fn final_info_proto(f: &FinalInfo) -> v1::FinalInfo {
    final_info(f)
}

/// Shapes a stream of engine events into protobuf chunks. Errors pass through immediately
/// (pending text is dropped: the stream failed). With passthrough options every event
/// becomes one chunk without timers.
pub fn shape<S, E>(
    events: S,
    opts: ShapeOptions,
) -> impl Stream<Item = Result<v1::GenerateChunk, E>>
where
    S: Stream<Item = Result<Event, E>> + Send + Unpin + 'static,
    E: Send + 'static,
{
    struct State<S> {
        events: Option<S>,
        shaper: Shaper,
        ready: VecDeque<v1::GenerateChunk>,
    }
    let state = State {
        events: Some(events),
        shaper: Shaper::new(opts),
        ready: VecDeque::new(),
    };
    futures::stream::unfold(state, move |mut st| async move {
        loop {
            if let Some(chunk) = st.ready.pop_front() {
                return Some((Ok(chunk), st));
            }
            if st.shaper.is_done() {
                return None;
            }
            let deadline = st.shaper.next_deadline();
            let Some(events) = st.events.as_mut() else {
                // Input ended (without a final event, or after an error): flush what
                // remains on schedule, then end.
                let deadline = deadline?;
                tokio::time::sleep_until(deadline).await;
                st.ready.extend(st.shaper.take_ready(Instant::now()));
                continue;
            };
            let next = match deadline {
                Some(d) => tokio::select! {
                    biased;
                    () = tokio::time::sleep_until(d) => None,
                    item = events.next() => Some(item),
                },
                None => Some(events.next().await),
            };
            match next {
                None => st.ready.extend(st.shaper.take_ready(Instant::now())),
                Some(Some(Ok(event))) => {
                    st.shaper.push(event);
                    if st
                        .shaper
                        .next_deadline()
                        .is_some_and(|d| d <= Instant::now())
                    {
                        st.ready.extend(st.shaper.take_ready(Instant::now()));
                    }
                }
                Some(Some(Err(e))) => {
                    // The stream failed: drop pending text, end after the error.
                    st.events = None;
                    st.shaper = Shaper::new(opts);
                    return Some((Err(e), st));
                }
                Some(None) => st.events = None,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerolayer_engine::api::{FinishReason, ReuseOutcome, Timings, Usage};

    fn tokens(text: &str, id: u32, generated: u32) -> Event {
        Event::Tokens {
            text: text.into(),
            token_ids: vec![id],
            context: ContextState {
                generated_tokens: generated,
                ..Default::default()
            },
        }
    }

    fn finished(generated: u32) -> Event {
        Event::Finished(FinalInfo {
            handle: Some(vec![7; 4]),
            finish_reason: FinishReason::Length,
            usage: Usage::default(),
            timings: Timings::default(),
            reuse: ReuseOutcome::New,
            session_id: 9,
            context: ContextState {
                generated_tokens: generated,
                ..Default::default()
            },
        })
    }

    fn collect_all(opts: ShapeOptions, events: Vec<Event>) -> Vec<v1::GenerateChunk> {
        let mut s = Shaper::new(opts);
        let mut now = Instant::now();
        let mut out = Vec::new();
        for e in events {
            s.push(e);
            out.extend(s.take_ready(now));
        }
        while let Some(d) = s.next_deadline() {
            now = now.max(d);
            out.extend(s.take_ready(now));
        }
        out
    }

    #[test]
    fn passthrough_sends_one_chunk_per_event_and_a_final_chunk() {
        let chunks = collect_all(
            ShapeOptions::default(),
            vec![tokens("He", 1, 1), tokens("llo", 2, 2), finished(2)],
        );
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[0].text, "He");
        assert_eq!(chunks[1].token_ids, vec![2]);
        assert!(chunks[2].r#final.is_some());
        assert_eq!(chunks[2].context.expect("context").generated_tokens, 2);
    }

    #[test]
    fn no_chunk_exceeds_max_buffer_size_and_text_and_ids_are_preserved() {
        let opts = ShapeOptions {
            max_buffer_size: 3,
            spacing: Duration::ZERO,
        };
        let chunks = collect_all(
            opts,
            vec![
                tokens("abcdefg", 1, 1),
                tokens("héllo wörld", 2, 2),
                finished(2),
            ],
        );
        assert!(chunks.iter().all(|c| c.text.len() <= 3), "{chunks:?}");
        let text: String = chunks.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(text, "abcdefghéllo wörld");
        let ids: Vec<u32> = chunks.iter().flat_map(|c| c.token_ids.clone()).collect();
        assert_eq!(ids, vec![1, 2]);
        assert!(chunks.last().expect("final").r#final.is_some());
    }

    #[test]
    fn a_limit_below_one_character_still_makes_progress() {
        let opts = ShapeOptions {
            max_buffer_size: 1,
            spacing: Duration::ZERO,
        };
        let chunks = collect_all(opts, vec![tokens("é€", 1, 1), finished(1)]);
        let texts: Vec<&str> = chunks.iter().map(|c| c.text.as_str()).collect();
        // The final event arrives after the text was sent: it gets a chunk of its own.
        assert_eq!(texts, vec!["é", "€", ""]);
        assert!(chunks[2].r#final.is_some());
    }

    #[test]
    fn spacing_coalesces_tokens_produced_between_chunks() {
        let opts = ShapeOptions {
            max_buffer_size: 0,
            spacing: Duration::from_millis(50),
        };
        let mut s = Shaper::new(opts);
        let t0 = Instant::now();
        s.push(tokens("a", 1, 1));
        let first = s.take_ready(t0);
        assert_eq!(first.len(), 1, "first chunk is not delayed");
        s.push(tokens("b", 2, 2));
        s.push(tokens("c", 3, 3));
        assert!(s.take_ready(t0 + Duration::from_millis(10)).is_empty());
        let second = s.take_ready(t0 + Duration::from_millis(50));
        assert_eq!(second.len(), 1);
        assert_eq!(second[0].text, "bc");
        assert_eq!(second[0].token_ids, vec![2, 3]);
        assert_eq!(second[0].context.expect("ctx").generated_tokens, 3);
        s.push(finished(3));
        assert!(
            s.take_ready(t0 + Duration::from_millis(60)).is_empty(),
            "final waits too"
        );
        let last = s.take_ready(t0 + Duration::from_millis(100));
        assert!(last[0].r#final.is_some());
        assert!(s.is_done());
    }

    #[test]
    fn high_rtt_widens_spacing() {
        let o = ShapeOptions::from_proto(Some(&v1::StreamOptions {
            max_buffer_size: 0,
            min_delay_ms: 10,
            network_rtt_ms: 200,
        }));
        assert_eq!(o.spacing, Duration::from_millis(100));
        assert!(ShapeOptions::from_proto(None).is_passthrough());
    }

    #[tokio::test(start_paused = true)]
    async fn the_async_driver_respects_spacing_between_every_chunk() {
        let opts = ShapeOptions {
            max_buffer_size: 4,
            spacing: Duration::from_millis(20),
        };
        let events: Vec<Result<Event, ()>> = vec![
            Ok(tokens("hello ", 1, 1)),
            Ok(tokens("world", 2, 2)),
            Ok(finished(2)),
        ];
        let stream = shape(futures::stream::iter(events), opts);
        futures::pin_mut!(stream);
        let mut times = Vec::new();
        let mut text = String::new();
        let mut saw_final = false;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.expect("no error");
            times.push(Instant::now());
            assert!(chunk.text.len() <= 4);
            text.push_str(&chunk.text);
            saw_final |= chunk.r#final.is_some();
        }
        assert_eq!(text, "hello world");
        assert!(saw_final);
        for pair in times.windows(2) {
            assert!(pair[1] - pair[0] >= Duration::from_millis(20), "{times:?}");
        }
    }

    #[tokio::test]
    async fn errors_pass_through_and_end_the_stream() {
        let events: Vec<Result<Event, &str>> = vec![Ok(tokens("a", 1, 1)), Err("boom")];
        let stream = shape(futures::stream::iter(events), ShapeOptions::default());
        let items: Vec<_> = stream.collect().await;
        assert_eq!(items.len(), 2);
        assert!(items[1].is_err());
    }
}
