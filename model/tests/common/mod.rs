//! Helpers shared by the model tests: locating the stories260K test model and a naive reference
//! forward pass (llama2.c's `run.c`, transcribed loop by loop) to check the backend against.

#![allow(dead_code)]

use std::path::PathBuf;

use zerolayer_model::{Model, Weights, load_model};

/// `ZEROLAYER_MODELS_DIR`, else `../shared/models` relative to the workspace root.
pub fn models_dir() -> PathBuf {
    match std::env::var_os("ZEROLAYER_MODELS_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/models"),
    }
}

/// The stories260K model, or `None` (with a visible skip message) when it is absent.
pub fn stories260k(test: &str) -> Option<Model> {
    let dir = models_dir().join("stories260K");
    let ckpt = dir.join("stories260K.bin");
    if !ckpt.is_file() {
        eprintln!(
            "SKIPPED {test}: {} not found (set ZEROLAYER_MODELS_DIR)",
            ckpt.display()
        );
        return None;
    }
    Some(
        load_model(
            ckpt.to_str().expect("utf-8 path"),
            Some(&dir.join("tok512.bin")),
        )
        .expect("stories260K loads"),
    )
}

/// The README's reference continuation (the fenced block after "Reference output").
pub fn stories260k_reference() -> String {
    let readme = std::fs::read_to_string(models_dir().join("stories260K/README.md"))
        .expect("README readable");
    let after = &readme[readme.find("Reference output").expect("reference section")..];
    let start = after.find("```\n").expect("opening fence") + 4;
    let end = after[start..].find("```").expect("closing fence") + start;
    after[start..end].trim_end_matches('\n').to_string()
}

/// llama2.c's forward pass for one sequence, written as plainly as `run.c` (no SIMD, no paging):
/// returns the logits after feeding `tokens` one by one from position 0.
pub fn reference_logits(w: &Weights, tokens: &[u32]) -> Vec<Vec<f32>> {
    let c = w.config();
    let (d, hd, kvd, hid) = (c.dim, c.head_dim(), c.kv_dim(), c.hidden_dim);
    let kv_mul = c.n_heads / c.n_kv_heads;
    let mut kcache = vec![vec![0.0f32; c.max_seq_len * kvd]; c.n_layers];
    let mut vcache = vec![vec![0.0f32; c.max_seq_len * kvd]; c.n_layers];
    let matmul = |out: &mut [f32], x: &[f32], wt: &[f32], n: usize| {
        for (i, o) in out.iter_mut().enumerate() {
            *o = (0..n).map(|j| wt[i * n + j] * x[j]).sum();
        }
    };
    let rmsnorm = |out: &mut [f32], x: &[f32], g: &[f32]| {
        let ss = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + c.norm_eps;
        let inv = 1.0 / ss.sqrt();
        for i in 0..x.len() {
            out[i] = g[i] * (inv * x[i]);
        }
    };
    let mut all = Vec::new();
    for (pos, &tok) in tokens.iter().enumerate() {
        let mut x = w.token_embedding()[tok as usize * d..(tok as usize + 1) * d].to_vec();
        let mut xb = vec![0.0; d];
        for (l, lw) in w.layers().iter().enumerate() {
            rmsnorm(&mut xb, &x, &lw.rms_att);
            let mut q = vec![0.0; d];
            let mut k = vec![0.0; kvd];
            let mut v = vec![0.0; kvd];
            matmul(&mut q, &xb, &lw.wq, d);
            matmul(&mut k, &xb, &lw.wk, d);
            matmul(&mut v, &xb, &lw.wv, d);
            for i in (0..d).step_by(2) {
                let head_dim = i % hd;
                let freq = 1.0f32 / c.rope_theta.powf(head_dim as f32 / hd as f32);
                let val = pos as f32 * freq;
                let (fcr, fci) = (val.cos(), val.sin());
                let rot = |vec: &mut [f32]| {
                    let (v0, v1) = (vec[i], vec[i + 1]);
                    vec[i] = v0 * fcr - v1 * fci;
                    vec[i + 1] = v0 * fci + v1 * fcr;
                };
                rot(&mut q);
                if i < kvd {
                    rot(&mut k);
                }
            }
            kcache[l][pos * kvd..(pos + 1) * kvd].copy_from_slice(&k);
            vcache[l][pos * kvd..(pos + 1) * kvd].copy_from_slice(&v);
            let mut att_out = vec![0.0; d];
            for h in 0..c.n_heads {
                let qh = &q[h * hd..(h + 1) * hd];
                let mut att: Vec<f32> = (0..=pos)
                    .map(|t| {
                        let kt = &kcache[l][t * kvd + (h / kv_mul) * hd..][..hd];
                        qh.iter().zip(kt).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
                    })
                    .collect();
                let max = att.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                for a in &mut att {
                    *a = (*a - max).exp();
                    sum += *a;
                }
                for (t, a) in att.iter().enumerate() {
                    let vt = &vcache[l][t * kvd + (h / kv_mul) * hd..][..hd];
                    for i in 0..hd {
                        att_out[h * hd + i] += a / sum * vt[i];
                    }
                }
            }
            let mut o = vec![0.0; d];
            matmul(&mut o, &att_out, &lw.wo, d);
            for i in 0..d {
                x[i] += o[i];
            }
            rmsnorm(&mut xb, &x, &lw.rms_ffn);
            let mut h1 = vec![0.0; hid];
            let mut h3 = vec![0.0; hid];
            matmul(&mut h1, &xb, &lw.w1, d);
            matmul(&mut h3, &xb, &lw.w3, d);
            for i in 0..hid {
                h1[i] = h1[i] * (1.0 / (1.0 + (-h1[i]).exp())) * h3[i];
            }
            matmul(&mut o, &h1, &lw.w2, hid);
            for i in 0..d {
                x[i] += o[i];
            }
        }
        let mut xf = vec![0.0; d];
        rmsnorm(&mut xf, &x, w.rms_final());
        let mut logits = vec![0.0; c.vocab_size];
        matmul(&mut logits, &xf, w.classifier(), d);
        all.push(logits);
    }
    all
}
