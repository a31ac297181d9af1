"""Prompts shared by the parity tests: chat and plain, short and over 300 tokens."""

LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a "
    "goldsmith from Mainz, combined several existing technologies into a single system for producing "
    "books. Movable type had been used in East Asia for centuries, but Gutenberg's metal alloy, his "
    "oil-based ink and his adaptation of the screw press made mass production practical in Europe. "
    "Within fifty years, printing shops had spread to more than two hundred cities, and millions of "
    "volumes had been produced. The consequences were enormous. Scholars could compare identical copies "
    "of texts, errors could be corrected in later editions, and ideas travelled faster than ever before. "
    "The Reformation, the Scientific Revolution and the rise of vernacular literature all depended on "
    "cheap printed material. Pamphlets, broadsheets and eventually newspapers created a new public that "
    "debated politics and religion. Governments and churches tried to control the presses through "
    "licensing and censorship, but the sheer number of printers made complete control impossible. "
    "Over the following centuries, improvements such as the steam-powered rotary press, the Linotype "
    "machine and offset lithography further reduced costs, and literacy rates rose across the world. "
    "Historians still argue about how much of modern society can be traced back to this single "
    "invention, but few doubt that it changed the way people learned, worshipped and governed. "
    "Libraries grew from a few hundred manuscripts to collections of many thousands of books, and "
    "universities reorganised their teaching around printed textbooks that every student could own."
)

PARITY_PROMPTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"messages": [{"role": "user", "content": "Write a short poem about autumn leaves."}]},
    {"messages": [{"role": "user", "content": "Summarize this text in two sentences:\n\n" + LONG_TEXT}]},
    {"messages": [
        {"role": "system", "content": "You are a concise assistant that answers in one line."},
        {"role": "user", "content": "How many legs does a spider have?"},
    ]},
    {"prompt": "The quick brown fox"},
    {"prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"prompt": LONG_TEXT + "\n\nIn conclusion,"},
    {"prompt": "Once upon a time, in a small village by the sea,"},
]
