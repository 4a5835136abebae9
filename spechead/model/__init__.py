"""The models: the Llama-family target (config, layers, transformer, loading), the EAGLE drafters, the low-rank
head factors and the tokenizer; above the kernels, below everything that decodes or trains with them."""
