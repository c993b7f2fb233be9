"""Conversion of a pretrained base (`clover train --recipe convert | distill`, `clover campaign`): the
conversion objective, its data mixture, the LoRA adapter trainer for Clover and its autoregressive peer,
distillation on the model's own answers, and the campaign that trains and promotes the shipped pair
(docs/design.md section 7)."""
