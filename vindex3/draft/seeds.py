"""The default corpus for counting token frequencies (vocabulary-cut draft heads) and for fitting
drafters: short seed texts across prose, dialogue, lists, arithmetic and code. Deliberately NOT
the frozen prompt bank (prompts-v1.jsonl), which stays the held-out test set; none of these texts
is, or begins, a bank prompt."""

SEED_TEXTS: tuple[str, ...] = (
    "The river runs past the old mill and into the valley, where the town keeps its market on Saturdays.",
    "She opened the letter slowly, read it twice, and then folded it back into the envelope.",
    "In the morning the fog lifted from the harbour and the fishing boats went out one by one.",
    "A good recipe for bread needs flour, water, salt and yeast, and a little patience.",
    "The committee met on Tuesday to discuss the budget for the new library building.",
    "Photosynthesis converts light energy into chemical energy stored in sugar molecules.",
    "The train to the coast leaves every hour from platform four.",
    "He said: \"I will be there at six, unless the traffic is bad.\"",
    "Q: What is the boiling point of ethanol?\nA: About 78 degrees Celsius at sea level.",
    "Steps to repot a plant:\n1. Water it the day before.\n2. Loosen the roots.\n3. Move it to a larger pot.",
    "Shopping list:\n- eggs\n- milk\n- tomatoes\n- rice\n- coffee",
    "Seventeen plus twenty-five equals forty-two, and forty-two times two is eighty-four.",
    "12 * 12 = 144\n15 * 4 = 60\n81 / 9 = 9\n7 + 8 = 15",
    "The museum's collection includes paintings, sculptures, coins and old maps of the region.",
    "Dear team, thank you for your hard work this quarter. Our next meeting is on Friday.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)",
    "import json\n\nwith open('data.json') as f:\n    data = json.load(f)\nprint(len(data))",
    "function greet(name) {\n  return `Hello, ${name}!`;\n}\nconsole.log(greet('world'));",
    "UPDATE orders SET status = 'shipped' WHERE id IN (SELECT order_id FROM parcels);",
    "#include <stdio.h>\n\nint main(void) {\n    printf(\"hello\\n\");\n    return 0;\n}",
    "The summer was hot and dry, and by August the wells in the village had begun to run low.",
    "Mathematics is the study of numbers, shapes, patterns and the relations between them.",
    "User: Can you suggest a name for a small bakery?\nAssistant: How about \"The Rising Loaf\"?",
    "Once the glue has dried, sand the edges gently and apply a thin coat of varnish.",
    "The lighthouse keeper climbed the stairs every evening to light the lamp.",
    "Chapter 3. The storm arrived without warning, and the ship turned back toward the bay.",
    "Our solar panels produced 412 kilowatt hours in June, up from 365 in May.",
    "To convert Celsius to Fahrenheit, multiply by nine, divide by five and add thirty-two.",
)


def seed_continuations(container, tokens: int, rounds: int = 1, seed: int = 0,
                       temperature: float = 0.8, top_p: float = 0.95) -> list[list[int]]:
    """The model's own text: each seed text followed by up to ``tokens`` tokens the full model
    samples after it (`vindex3.generate.Sampler`, seeded per round and text, so a call is
    reproducible), ``rounds`` times over the seed list; a continuation stops at the model's
    end-of-text token. Token ids, one list a text. Many more fitting positions than the seeds
    alone, and still nothing of the prompt bank."""
    from ..errors import VindexError
    from ..generate import Sampler
    from .slices import open_container

    if not (isinstance(tokens, int) and tokens >= 0 and isinstance(rounds, int) and rounds >= 1):
        raise VindexError(f"seed continuations need tokens >= 0 and rounds >= 1; got {tokens!r}, {rounds!r}")
    c = open_container(container)
    ex = c.executor()
    eos = getattr(c.tokenizer, "eos_id", None)
    out: list[list[int]] = []
    for r in range(rounds):
        for i, text in enumerate(SEED_TEXTS):
            ids = [int(t) for t in c.tokenizer.encode(text)]
            pick = Sampler(temperature, top_p, seed + 1000 * r + i).start()
            st = ex.start()
            logits = st.prefill(ids, last_only=True)
            for _ in range(tokens):
                t = pick(logits.reshape(-1, logits.shape[-1])[-1])
                ids.append(t)
                if t == eos:
                    break
                logits = st.step(t)
            out.append(ids)
    return out
