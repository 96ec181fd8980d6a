"""The built-in open chat prompts `kvserve train draft` has the target answer.

A draft learns the target's style of answer and, as much, the words a subject calls for: with few
subjects it learns those subjects' answers and not answering in general (stop 41: a head right 0.70
of the time on its training prompts was right 0.47 on new subjects). So the prompts are drawn from
a wide space, several kinds of request (explanations, stories, poems, advice, lists, comparisons,
letters, how-tos) over some hundreds of subjects, characters and situations, each drawn once.

None of `kvserve bench latency --speculative`'s open prompts, or their subjects, is in the space:
the bench measures answers to requests the draft has not seen.

However wide, a table of phrasings is a few dozen shapes of request: a head trained on their answers
alone was right 0.75 of the time on unseen prompts of those shapes and 0.54 on other requests (stop
42). `self_prompts` widens the space the other way, with requests the target writes itself: sampled
from the chat template's user turn, they are as varied as the chat data the target was tuned on
(questions, code, tasks, some rambling), and a filter drops the broken ones and any on the bench's
subjects.
"""

from __future__ import annotations

import random

# the bench's open prompts' subjects (bench/spec_latency.py): never asked of the target in training
BENCH_SUBJECTS = (("robot", "paint"), ("bicycle",), ("rainy", "sunday"), ("working from home",),
                  ("work from home",), ("remote work",))

TOPICS = (
    # nature and science
    "the ocean", "the moon", "volcanoes", "honey bees", "dinosaurs", "penguins", "the desert", "owls", "spiders",
    "the water cycle", "the solar system", "the rain forest", "earthquakes", "coral reefs", "black holes",
    "photosynthesis", "magnets", "rainbows", "tides", "glaciers", "bird migration", "mushrooms", "octopuses",
    "the human brain", "the immune system", "DNA", "electricity", "gravity", "light", "sound", "fossils",
    "comets", "the northern lights", "wolves", "whales", "elephants", "ants", "butterflies", "rivers", "caves",
    "clouds", "lightning", "hurricanes", "seeds", "trees in autumn", "the periodic table", "atoms", "bacteria",
    "vaccines", "the human heart", "sleep", "dreams", "memory", "the five senses", "evolution", "soil",
    # technology
    "electric cars", "the internet", "solar power", "wind turbines", "space telescopes", "robots in factories",
    "smartphones", "email", "batteries", "3D printing", "GPS", "search engines", "passwords", "cloud storage",
    "video calls", "satellites", "the printing press", "the telephone", "airplanes", "submarines", "bridges",
    "skyscrapers", "microwave ovens", "washing machines", "artificial intelligence", "spreadsheets",
    "programming languages", "computer viruses", "online shopping", "social media", "podcasts", "drones",
    # daily life, home and food
    "bread baking", "coffee", "tea", "cooking pasta", "healthy breakfasts", "a family dinner", "a picnic",
    "meal planning", "grocery shopping", "keeping a kitchen clean", "composting", "houseplants", "a small garden",
    "moving to a new home", "decorating a room", "saving energy at home", "fixing a leaky tap", "laundry",
    "soup", "spices", "chocolate", "cheese making", "fermented food", "street food", "vegetarian cooking",
    "leftovers", "a lunch box", "a farmers market", "a village market", "a small bakery",
    # health and habits
    "morning routines", "drinking enough water", "stretching", "yoga", "running a marathon", "walking every day",
    "first aid", "stress", "screen time", "a good night's sleep", "posture", "healthy snacks", "meditation",
    "keeping a journal", "quitting sugar", "learning to swim", "cycling to work", "hiking safety",
    # work, money and learning
    "saving money", "a first job", "a job interview", "writing a resume", "time management", "public speaking",
    "budget travel", "the stock market", "learning a language", "learning to code", "studying for exams",
    "taking notes", "online courses", "team meetings", "asking for a raise", "starting a small business",
    "customer service", "negotiation", "credit cards", "paying off debt", "renting an apartment", "taxes",
    "a science fair", "homework", "reading more books", "learning math", "teaching a class", "giving feedback",
    # culture, history and places
    "the Roman Empire", "ancient Egypt", "the history of writing", "old castles", "the Silk Road", "the Vikings",
    "the Renaissance", "the Olympic Games", "museums", "libraries", "a city at night", "a mountain lake",
    "a snowy village", "a lighthouse", "a desert town", "an island", "a busy train station", "Paris", "Tokyo",
    "the Amazon river", "the Great Wall of China", "jazz", "classical music", "folk songs", "opera", "painting",
    "sculpture", "photography", "film making", "theatre", "comic books", "poetry", "fairy tales", "myths",
    # hobbies, sport and play
    "chess", "board games", "video games", "kites", "paper airplanes", "a magic trick", "knitting", "pottery",
    "woodworking", "bird watching", "stamp collecting", "camping", "fishing", "rock climbing", "skiing",
    "football", "basketball", "tennis", "table tennis", "a chess club", "a football match", "a music festival",
    "playing the guitar", "playing the piano", "singing in a choir", "dancing", "juggling", "origami",
    "a road trip", "a train journey", "a long flight", "a sailing boat", "a treehouse", "a hiking trip",
    # people and feelings
    "friendship", "a birthday party", "a new puppy", "a lost cat", "grandparents", "a new neighbour",
    "being a good listener", "making new friends", "moving abroad", "a wedding", "a surprise party", "kindness",
    "patience", "courage", "curiosity", "homesickness", "a first day at school", "a family tradition",
    "volunteering", "a lost key", "an old map", "a rainy morning", "winter", "spring", "summer holidays",
    "a thunderstorm", "a haunted house", "a time capsule", "a letter from the past", "a secret door",
)

CHARACTERS = (
    "a shy dragon", "an old lighthouse keeper", "a talking cat", "a young astronaut", "a lonely snowman",
    "a clumsy wizard", "a brave mouse", "a retired pirate", "a curious little girl", "a grumpy baker",
    "a lost penguin", "a tiny robot", "a forgetful king", "a kind giant", "a detective dog", "a ghost",
    "an ant", "a fox", "a young farmer", "a musician", "a teacher", "a librarian", "a taxi driver", "an owl",
    "a boy and his grandfather", "two rival chefs", "a sleepy bear", "a mermaid", "a time traveller",
    "a gardener", "a nervous student", "a street cat", "an inventor", "a knight", "a squirrel",
)
GOALS = (
    "wants to fly", "finds a mysterious key", "is afraid of the dark", "loses something important",
    "makes an unlikely friend", "has to save the village", "learns to cook", "travels to the sea for the first time",
    "discovers a hidden garden", "wants to win a race", "tries to keep a secret", "gets lost in a big city",
    "opens a small shop", "learns to sing", "finds a message in a bottle", "builds a boat",
    "has one wish", "wakes up a hundred years later", "must cross a mountain", "wants to be taller",
    "plants a tree", "solves a mystery", "writes a letter to the moon", "helps a stranger",
)
DEVICES = (
    "a refrigerator", "a microwave oven", "a thermometer", "an elevator", "a camera", "a car engine",
    "a solar panel", "a light bulb", "a clock", "a compass", "a telescope", "a smoke detector", "a vacuum cleaner",
    "a rocket", "a heart", "a battery", "a radio", "a lock and key", "a wind turbine", "a toaster", "a piano",
    "a submarine", "a helicopter", "a touch screen", "a printer", "a dishwasher", "a sewing machine", "a bridge",
    "a pump", "a hot air balloon", "a parachute", "a traffic light", "a barcode scanner", "an umbrella",
)
AUDIENCES = ("", " to a child", " to a teenager", " to my grandmother", " in simple terms", " step by step",
             " in a few sentences", " to someone who has never seen one")
OCCASIONS = (
    "a snowy weekend", "a child's birthday party", "a first date", "a long car journey", "a lazy summer evening",
    "a school fundraiser", "a small wedding", "a team lunch", "a holiday at home", "a science project",
    "a family reunion", "a quiet evening alone", "a beach day", "a garden party", "a book club meeting",
    "a trip to the mountains", "a farewell gift for a colleague", "a new year's resolution", "a blog",
    "a short film", "a healthy dinner", "a community event", "keeping kids busy indoors", "learning something new",
    "saving money this month", "a camping trip", "a tiny balcony garden", "a cheap day out", "a bake sale",
)
FORMATS = ("", ", with one sentence on each", " and explain each briefly", " as a numbered list")
ACTIVITIES = (
    "living in the countryside", "owning a car", "studying abroad", "eating out every day", "buying a used phone",
    "learning two languages at once", "having a pet", "working night shifts", "homeschooling", "renting a home",
    "using public transport", "shopping online", "getting up very early", "social media for teenagers",
    "electric bikes", "a four-day work week", "wearing a school uniform", "self-driving cars", "nuclear power",
    "living alone", "freelance work", "open-plan offices", "travelling by train", "reading e-books",
    "going to university", "starting a business young", "living near the sea", "a vegetarian diet",
)
TASKS = (
    "make new friends as an adult", "stop procrastinating", "start running", "write a good essay",
    "remember what I read", "make a budget", "learn to draw", "grow tomatoes", "prepare for a long hike",
    "plan a trip on a small budget", "fall asleep faster", "cook rice properly", "choose a good book",
    "start a podcast", "get better at chess", "take better photos with my phone", "clean a cast iron pan",
    "train my dog to sit", "write a cover letter", "calm down before an exam", "organise my desk",
    "speak up in meetings", "learn to type faster", "make my own bread", "keep a conversation going",
    "care for a cactus", "apologise to a friend", "choose a laptop", "build a habit", "say no politely",
)
QUESTIONS = (
    "Why is the sky blue?", "Why do cats purr?", "Why do leaves change colour in autumn?", "Why is the sea salty?",
    "How do birds know where to migrate?", "What makes a good leader?", "Why do we dream?",
    "How do vaccines work?", "What is the difference between weather and climate?", "Why do onions make us cry?",
    "How does the internet reach my house?", "What happens when we sleep?", "Why do we have time zones?",
    "How are rainbows made?", "Why does bread rise?", "What is inflation?", "How do plants drink water?",
    "Why do we yawn?", "What is a black hole?", "How do airplanes stay in the air?", "Why do stars twinkle?",
    "How does a seed know which way is up?", "What is the best way to learn new words?",
    "What makes music sound happy or sad?", "How do noise-cancelling headphones work?",
)
PAIRS = (
    ("a virus", "a bacterium"), ("weather", "climate"), ("a lake", "a pond"), ("tea", "coffee"),
    ("a crocodile", "an alligator"), ("baking soda", "baking powder"), ("a comet", "an asteroid"),
    ("a novel", "a short story"), ("saving", "investing"), ("a town", "a city"), ("jam", "jelly"),
    ("a moth", "a butterfly"), ("hardware", "software"), ("a hill", "a mountain"), ("rugby", "football"),
    ("a violin", "a viola"), ("a frog", "a toad"), ("speed", "velocity"), ("a sea", "an ocean"),
)
LETTERS = ("a friendly email to a colleague", "a short thank-you note to a neighbour", "a polite complaint letter",
           "a birthday message to an old friend", "an invitation to my friends", "a short apology note",
           "a letter to my future self", "a welcome message for a new team member", "a note to my landlord")
SUBJECTS = ("a project deadline", "a broken heater", "a party next Saturday", "a lost parcel", "a book I loved",
            "a change of plans", "the school trip", "a noisy neighbour", "a new job", "a cooking class",
            "the office move", "a charity run", "a late payment", "a garden we share")
POEM_FORMS = ("a short poem", "a haiku", "a limerick", "a four-line rhyme", "a song verse", "a free verse poem")
SITUATIONS = (
    "I feel tired every afternoon", "I have too many things to do this week", "my friend forgot my birthday",
    "I want to change careers", "I am nervous about a presentation", "my plants keep dying",
    "I cannot decide what to study", "I moved to a new city and know nobody", "my neighbours are very loud",
    "I want to read more but never find the time", "I spend too much money on food", "I keep losing my keys",
    "my child does not want to do homework", "I want to get fit but hate the gym", "I forgot an important meeting",
)
TOPIC_TEMPLATES = (
    "Tell me about {t}.", "Explain {t} in simple words.", "Give three interesting facts about {t}.",
    "What should a beginner know about {t}?", "Describe {t} in one paragraph.", "List some tips related to {t}.",
    "Why do people care about {t}?", "Explain {t} to a child.",
    "Give me some ideas involving {t}.", "What is the history of {t}?", "Summarize what you know about {t}.",
    "Write a short speech about {t}.", "What are common mistakes people make with {t}?",
    "Describe a day involving {t}.", "Write a dialogue between two friends about {t}.",
    "Write a story about {t}.", "Write a short story that involves {t}.", "What do most people get wrong about {t}?",
    "Write a short blog post about {t}.", "Teach me something surprising about {t}.",
    "Write a product description inspired by {t}.", "Give me a quiz with three questions about {t}.",
    "Write the opening paragraph of a novel about {t}.", "What would the world be like without {t}?",
    "Explain {t} as if you were a tour guide.", "Write a diary entry about {t}.",
)


def _space() -> list[tuple[str, ...]]:
    """Every prompt as the tuple of its parts (kind first): cheap to list, unique by construction."""
    out: list[tuple[str, ...]] = [("topic", tpl, t) for t in TOPICS for tpl in TOPIC_TEMPLATES]
    out += [("story", c, g) for c in CHARACTERS for g in GOALS]
    out += [("device", d, a) for d in DEVICES for a in AUDIENCES]
    out += [("ideas", o, n, f) for o in OCCASIONS for n in ("three", "four", "five", "six") for f in FORMATS]
    out += [("proscons", a, s) for a in ACTIVITIES for s in ("What are the pros and cons of {a}?",
                                                              "Is {a} a good idea? Give both sides.",
                                                              "Argue for and against {a}.")]
    out += [("howto", t, s) for t in TASKS for s in ("How do I {x}?", "How can I {x}?", "Give me a plan to {x}.",
                                                      "What is the easiest way to {x}?")]
    out += [("question", q) for q in QUESTIONS]
    out += [("compare", a, b) for a, b in PAIRS]
    out += [("letter", k, s) for k in LETTERS for s in SUBJECTS]
    out += [("poem", f, t) for f in POEM_FORMS for t in TOPICS]
    out += [("advice", s, q) for s in SITUATIONS for q in ("What should I do?", "Any advice?", "How can I fix this?")]
    return out


_SHAPES = {"story": "Write a short story about {0} who {1}.", "device": "Explain how {0} works{1}.",
           "ideas": "Give me {1} ideas for {0}{2}.", "question": "{0}", "letter": "Write {0} about {1}.",
           "compare": "What is the difference between {0} and {1}?", "poem": "Write {0} about {1}.",
           "advice": "{0}. {1}"}


def _text(parts: tuple[str, ...]) -> str:
    kind, *p = parts
    if kind in _SHAPES:
        return _SHAPES[kind].format(*p)
    return p[0].format(t=p[1]) if kind == "topic" else p[1].format(a=p[0], x=p[0])     # proscons, howto


# how often each kind of request is drawn (a kind runs out at its size): subjects x phrasings alone
# would be two thirds of the space
WEIGHTS = {"topic": 0.36, "story": 0.14, "poem": 0.09, "ideas": 0.1, "device": 0.07, "howto": 0.07,
           "letter": 0.05, "proscons": 0.04, "advice": 0.03, "question": 0.025, "compare": 0.025}


def chat_prompts(n: int | None = None, seed: int = 0) -> list[str]:
    """n distinct prompts (all of the space if n is None or larger), kinds drawn by WEIGHTS."""
    rng = random.Random(seed)
    by_kind: dict[str, list[tuple[str, ...]]] = {}
    for parts in _space():
        by_kind.setdefault(parts[0], []).append(parts)
    for v in by_kind.values():
        rng.shuffle(v)
    out: list[str] = []
    seen: set[str] = set()
    while by_kind and (n is None or len(out) < n):
        kinds = list(by_kind)
        kind = rng.choices(kinds, [WEIGHTS[k] for k in kinds])[0]
        text = _text(by_kind[kind].pop())
        if not by_kind[kind]:
            del by_kind[kind]
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def _usable(text: str) -> bool:
    """A self-written request worth answering: a few words or more, mostly Latin script (the target
    drifts into other scripts and mixed-up words at times), none of the bench's subjects."""
    if len(text.split()) < 3:
        return False
    if sum(c.isascii() for c in text) < 0.97 * len(text):
        return False
    low = text.lower()
    return not any(all(w in low for w in ws) for ws in BENCH_SUBJECTS)


def self_prompts(llm, tokenizer, n: int, seed: int = 0, temperature: float = 0.9,
                 max_rounds: int = 4) -> list[str]:
    """n distinct requests the target writes itself: its chat template up to the user's turn (the
    default system prompt included), sampled at `temperature` (top_p 0.95) until it ends the turn.
    Requests cut off at the token limit, in other scripts or on the bench's subjects are dropped
    (`_usable`); a request is sampled again until n are found, or `max_rounds` rounds run out."""
    from kvserve import SamplingParams

    text = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False)
    prefix = tokenizer.encode(text[:text.index("\x00")], add_special_tokens=False)
    out: list[str] = []
    seen: set[str] = set()
    r = 0
    while len(out) < n and r < max_rounds:
        want = int((n - len(out)) * 1.4) + 8
        params = [SamplingParams(temperature=temperature, top_p=0.95, max_tokens=96, seed=seed * 1_000_003 + r * 100_003 + i)
                  for i in range(want)]
        for o in llm.generate([{"prompt_token_ids": prefix}] * want, params, use_tqdm=False):
            c = o.outputs[0]
            t = c.text.strip()
            if c.finish_reason == "stop" and t not in seen and _usable(t):     # "length": cut off
                seen.add(t)
                out.append(t)
        r += 1
    return out[:n]
