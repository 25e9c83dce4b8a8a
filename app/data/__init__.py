"""The input pipeline: sampler (each worker's share of a seeded epoch order; windows for shards)
-> samples (bytes and label: reader, object_store, cache; or shard_reader, from local shards)
-> decode -> augment (the recipes' plan(), the same whichever decoder runs) -> a decoder's
pipeline behind one contract (pipeline, decoders: Pillow, nvJPEG, DALI) -> device batches
(device, batch_augment).

Imports only app.runtime, app.config and app.catalog. The modules DALI's reader processes run
(dali_source and what it imports) import no torch (tests/test_layout.py).
"""
