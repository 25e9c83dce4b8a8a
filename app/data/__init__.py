"""The input pipeline: sampler (this worker's share of a seeded epoch order; windows for
shards) -> samples (bytes and label: reader, many requests in flight, object_store, cache; or
shard_reader, by offset from local shards) -> decode -> augment (the recipes' plan(): crops,
flips, auto-augment, the same whichever decoder runs) -> a decoder's pipeline behind one contract
(pipeline, decoders: Pillow, nvJPEG on the device, DALI) -> device batches (device,
batch_augment).

Imports only app.runtime, app.config and app.catalog. The modules DALI's reader processes run
(dali_source and what it imports) import no torch; tests/test_layout.py checks it.
"""
