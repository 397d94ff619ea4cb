"""The anchors: what users run today (slime's optimizer and weight update, Megatron's own setups), re-implemented
where needed, so every benchmark and the colocated example put ebbtide beside the same thing. Nothing in the
library's components imports this package."""
