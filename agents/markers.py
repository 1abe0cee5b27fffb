"""Fixed strings of the rendered prompts that other parts may rely on."""

# The first line of the memory block in the actor prompt.
MEMORY_MARKER = "Your memory for the task below:"
