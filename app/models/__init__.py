"""The networks: the model factory by name (factory), reading saved models of every kind we take
(saved_weights) and matching them to a new model (pretrained).

Imports only app.runtime, app.config, app.catalog and app.data. No face here: the factory
imports timm, which alone takes seconds, and the driver must not pay for it.
"""
