//! Llama models on CPU: loaders, tokenizer, sampling and the backend trait.
