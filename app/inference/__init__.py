"""After training: predict (classes of images), export (timm's local-dir form, ONNX) and validate
(top-1/top-5 over a val split), each from a saved model opened by model_files.

Imports the packages below it; validate runs the driver's evaluation (app.launch.run), which
puts this package above launch. Never the training loop's internals.
"""
