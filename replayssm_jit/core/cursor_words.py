"""A slot's cursor words (cursors [slots, CURSOR_WORDS], int32; docs/design.md): a leaf module,
so that the torch path (ops/torch_path/) and every layer above can name them."""

CURSOR_WORDS = 4
# Records held since the last flush, the flush epoch, the count of CTAs done reading the cursor
# (0 between steps), and pending drafts from a verify.
CURSOR_HELD, CURSOR_EPOCH, CURSOR_ARRIVALS, CURSOR_PENDING = range(CURSOR_WORDS)
