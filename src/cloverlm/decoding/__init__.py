"""Block-diffusion decoding on token ids (docs/design.md section 4): what a request asks for (params),
the unmasking rules, a request's row state, the engine, prompt-lookup drafts, grammar constraints, the
block-size head and joint decisions. Knows nothing of tokenizers' text or HTTP."""
