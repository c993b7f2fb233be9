"""The memory graft's training (issue 30): stage 1 fits each grafted memory layer to the attention it
replaced (stage1.py), `clover graft-select` scores which layers stay attention (select.py), stage 2 trains
the whole hybrid on logit KL against the all-attention model (stage2.py). base.py holds what the stages share."""
