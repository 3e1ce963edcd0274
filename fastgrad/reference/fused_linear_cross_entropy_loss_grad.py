"""PLACEHOLDER — to be written (fused_linear_cross_entropy_loss_grad, reference)."""
