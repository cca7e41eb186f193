"""The LM head's autograd Function, split by job (see ``docs/fused-logprobs.md``).

Stage: the second half of the forward stage's fused path.
:func:`grimoire.forward.fused_head.fused_token_logps` gathers the rows that have a target and
calls :class:`~grimoire.forward.head.function._HeadLogps` on them.

* :mod:`~grimoire.forward.head.function`: the autograd Function (its two routes to the head's
  gradients, recompute in backward or eager in the forward, and RNG replay for dropout heads);
* :mod:`~grimoire.forward.head.softmax`: the softmax math (statistics and closed-form
  gradients, fp32, in place, in row blocks);
* :mod:`~grimoire.forward.head.linear`: the plain ``nn.Linear`` fast path (matmuls by hand);
* :mod:`~grimoire.forward.head.workspace`: the per-thread CPU buffers every head call reuses.
"""
