"""The model: one decoder for the Llama family and its relatives, what each family is, the
loaders of each checkpoint format, and the tokenizer.

    decoder.py     the decoder (Flax NNX): parameters declared once, the per-layer math
    moe.py         the mixture-of-experts MLP: the router and the experts' paths
    quantized.py   weights stored quantized (quantization="int8" / "fp8"): codes and
                   per-output-channel scales in the params tree, their shardings
    smoothing.py   int8's SmoothQuant-style smoothing of the float weights before they
                   are quantized, calibrated on data/calibration.txt
    family.py      what a model family is (`Family`): names, config rules, tensor tables
    families/      one module per family (`llama`, `qwen2_moe`, ...) and the registry
    tensors.py     jaxpipe's checkpoint tensor names, and how they stack into parameters
    rope_config.py HF's `rope_scaling` / `rope_parameters` -> `RopeScaling`
    hf_dir.py      HF checkpoint directories (config.json, *.safetensors)
    gguf_file.py   GGUF files (llama.cpp's format)
    gguf_weights.py a GGUF's matrices kept in their quantized blocks (quantization="gguf")
    gguf_quantized.py such a weight in the params tree (`GgufWeight`): its layout, shardings,
                   padding and bytes
    orbax_dir.py   orbax checkpoints (scripts/convert.py's)
    loading.py     a resolved model source -> its architecture, weights and tokenizer
    presets.py     where a model comes from: a preset in `models/`, or a path
    tokenizer.py   text <-> token ids, chat templates, incremental detokenization
"""
