//! Batch invariance, bit for bit: a sequence's logits are the same whether it runs alone token by
//! token, prefilled at once or in chunks of any size, batched with 7 other sequences in mixed
//! prefill/decode steps, on any thread count or instruction set.

mod common;

use std::sync::Arc;

use zerolayer_kernels::cpu::{CpuKernels, Isa};
use zerolayer_model::{
    Backend, CpuBackend, KvCacheConfig, ModelConfig, SeqChunk, Weights, dummy_weights,
};

const BLOCK: usize = 8;
const BLOCKS_PER_SEQ: usize = 16;

fn tiny() -> Arc<Weights> {
    Arc::new(dummy_weights(&ModelConfig::dummy("tiny").unwrap(), 11).unwrap())
}

fn backend(w: &Arc<Weights>, threads: usize) -> CpuBackend {
    CpuBackend::new(
        w.clone(),
        KvCacheConfig {
            block_size: BLOCK,
            num_blocks: 8 * BLOCKS_PER_SEQ,
        },
        threads,
    )
    .unwrap()
}

/// Blocks of sequence `s`, deliberately interleaved across the pool.
fn table(s: usize) -> Vec<u32> {
    (0..BLOCKS_PER_SEQ)
        .map(|b| (b * 8 + (s + b) % 8) as u32)
        .collect()
}

fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| 3 + (zerolayer_model::splitmix64(seed * 1000 + i) % (vocab as u64 - 3)) as u32)
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Logits after every position, feeding one token per step.
fn stepwise(be: &mut CpuBackend, toks: &[u32], tbl: &[u32]) -> Vec<Vec<f32>> {
    let vocab = be.config().vocab_size;
    toks.iter()
        .enumerate()
        .map(|(pos, t)| {
            let mut l = vec![0.0; vocab];
            be.forward(
                &[SeqChunk {
                    tokens: std::slice::from_ref(t),
                    start_pos: pos,
                    block_table: tbl,
                    want_logits: true,
                }],
                &mut l,
            )
            .unwrap();
            l
        })
        .collect()
}

/// Feeds `toks` in chunks of `size`, checking the logits at every chunk end against `want`.
fn check_chunked(be: &mut CpuBackend, toks: &[u32], tbl: &[u32], size: usize, want: &[Vec<f32>]) {
    let vocab = be.config().vocab_size;
    let mut pos = 0;
    for chunk in toks.chunks(size) {
        let mut l = vec![0.0; vocab];
        be.forward(
            &[SeqChunk {
                tokens: chunk,
                start_pos: pos,
                block_table: tbl,
                want_logits: true,
            }],
            &mut l,
        )
        .unwrap();
        pos += chunk.len();
        assert_eq!(
            bits(&l),
            bits(&want[pos - 1]),
            "chunk size {size}, position {}",
            pos - 1
        );
    }
}

fn invariance_suite(w: &Arc<Weights>) {
    let vocab = w.config().vocab_size;
    let n = 70;
    let seqs: Vec<Vec<u32>> = (0..8)
        .map(|s| tokens(s as u64 + 1, n - 3 * s, vocab))
        .collect();
    let mut alone = backend(w, 2);
    let reference: Vec<Vec<Vec<f32>>> = seqs
        .iter()
        .enumerate()
        .map(|(s, t)| stepwise(&mut alone, t, &table(s)))
        .collect();

    // Prefilled at once and in chunks of different sizes.
    for size in [n, 1, 3, 16, 33] {
        check_chunked(&mut alone, &seqs[0], &table(0), size, &reference[0]);
    }

    // Batched with 7 others: each step takes a chunk of a varying size from every unfinished
    // sequence (mixed prefill chunks and single decode tokens).
    let mut be = backend(w, 2);
    let mut pos = [0usize; 8];
    let tables: Vec<Vec<u32>> = (0..8).map(table).collect();
    let mut step = 0usize;
    while pos.iter().zip(&seqs).any(|(p, s)| *p < s.len()) {
        let mut chunks = Vec::new();
        let mut owners = Vec::new();
        for s in 0..8 {
            let left = seqs[s].len() - pos[s];
            if left == 0 {
                continue;
            }
            let size = left.min(1 + (step * 7 + s * 3) % 6);
            chunks.push(SeqChunk {
                tokens: &seqs[s][pos[s]..pos[s] + size],
                start_pos: pos[s],
                block_table: &tables[s],
                want_logits: true,
            });
            owners.push((s, pos[s] + size - 1));
            pos[s] += size;
        }
        let mut logits = vec![0.0; chunks.len() * vocab];
        be.forward(&chunks, &mut logits).unwrap();
        for (row, &(s, p)) in owners.iter().enumerate() {
            assert_eq!(
                bits(&logits[row * vocab..(row + 1) * vocab]),
                bits(&reference[s][p]),
                "sequence {s} position {p} in step {step}"
            );
        }
        step += 1;
    }

    // Other thread counts and instruction sets.
    for threads in [1, 3] {
        let mut be = backend(w, threads);
        check_chunked(&mut be, &seqs[1], &table(1), 9, &reference[1]);
    }
    for isa in Isa::available() {
        let kv = KvCacheConfig {
            block_size: BLOCK,
            num_blocks: 8 * BLOCKS_PER_SEQ,
        };
        let mut be =
            CpuBackend::with_kernels(w.clone(), kv, 2, CpuKernels::new(isa).unwrap()).unwrap();
        check_chunked(&mut be, &seqs[2], &table(2), 5, &reference[2]);
    }
}

#[test]
fn dummy_tiny_logits_are_bit_identical_alone_batched_chunked_and_on_any_isa() {
    invariance_suite(&tiny());
}

#[test]
fn stories260k_logits_are_bit_identical_alone_batched_chunked_and_on_any_isa() {
    let Some(model) = common::stories260k(
        "stories260k_logits_are_bit_identical_alone_batched_chunked_and_on_any_isa",
    ) else {
        return;
    };
    invariance_suite(&model.weights);
}

#[test]
fn copied_kv_continues_exactly_like_the_original_sequence() {
    let w = tiny();
    let vocab = w.config().vocab_size;
    let toks = tokens(5, 30, vocab);
    let mut be = backend(&w, 2);
    let want = stepwise(&mut be, &toks, &table(0));
    let mut l = vec![0.0; vocab];
    be.forward(
        &[SeqChunk {
            tokens: &toks[..20],
            start_pos: 0,
            block_table: &table(1),
            want_logits: false,
        }],
        &mut [],
    )
    .unwrap();
    be.copy_kv(&table(1), &table(2), 20).unwrap();
    be.forward(
        &[SeqChunk {
            tokens: &toks[20..],
            start_pos: 20,
            block_table: &table(2),
            want_logits: true,
        }],
        &mut l,
    )
    .unwrap();
    assert_eq!(bits(&l), bits(&want[29]));
}
