"""The step's attention and matmul kernels and the plain-jnp math they are checked against,
below the model: hand-written C++ CPU kernels called from jitted code through `jax.ffi` (built
once per machine), and a Pallas attention kernel for GPUs.

    attention_math.py    attention and RoPE in jnp: the model's math, every kernel's reference
    paged.py             the paged KV pool as every attention path reads it: block tables,
                         OUT_OF_RANGE, the storage dtype (bf16 as u16 bits on CPU; int8)
    kv_int8.py           the int8 KV cache's rows: D codes and a bf16 scale per token and KV
                         head, quantize / dequantize
    ragged_attention.py  ragged query spans over the paged pool: the C++ kernel
                         (ragged_attention.cc) and the same contract in jnp (`reference`)
    pallas_attention.py  that contract in Pallas (Triton on GPU; interpreted on CPU for tests)
    matmul.py            x @ w with bf16 weights in panel order (matmul.cc), and the MoE
                         experts' grouped matmul
    int8.py              dynamic W8A8's arithmetic in jnp: per-column weight and per-row
                         activation quantization, XLA's int8 dot (the int8 reference)
    int8_matmul.py       x @ w with int8 weights in int8 panel order (int8_matmul.cc): VNNI,
                         AVX2 and AMX int8 paths
    fp8.py               dynamic fp8 (e4m3) W8A8's arithmetic in jnp: per-column weights,
                         per-row activations, XLA's fp8 dot (quantization="fp8", for GPUs)
    gguf_blocks.py       GGUF's quantized blocks (q8_0, q4_0, q4_1, q4_k, q6_k) in jnp: decoding,
                         llama.cpp's q8_0 / q8_1 / q8_k activations, XLA's dot of the pair
                         (the GGUF reference)
    gguf_matmul.py       x @ w with w in the GGUF file's blocks, decoded in registers
                         (gguf_matmul.cc): AVX2, AVX-VNNI and AVX-512 VNNI paths
    empty.py             an array XLA allocates and no program writes (empty.cc)
    build.py             compiles a C++ kernel once per machine and registers its handler
"""
