"""Tensors: v2 datatypes and their numpy dtypes (``datatypes``), values from clients made
into arrays without a silent change (``values``), and the check of a stage's declared
inputs (``inputs``)."""
