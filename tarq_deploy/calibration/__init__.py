"""The calibration layer: the quantize options schema, the pipeline from a model and a corpus to a lattice checkpoint,
the sequential driver and its resumable work directory. Above quant/, models/, data/ and the checkpoint; below the
formats and the commands."""
