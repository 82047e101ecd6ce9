"""Counting and probing models: parameters and FLOPs on the meta device (``params``), the
UT paper's encoder-decoder accounting (``accounting``), what happens inside a forward pass
(``probe``), the UT explainer's numbers (``ut_explainer``) and plots (``plots``)."""
