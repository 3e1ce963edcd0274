"""PLACEHOLDER — to be written (smooth_l1_loss_backward, reference)."""
