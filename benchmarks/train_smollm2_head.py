"""Train an EAGLE-3 (or EAGLE / Medusa) head for SmolLM2-135M-Instruct on text available offline.

Data = (1) SmolLM2's own greedy chat answers to up to three disjoint sets of training prompts
(self-distillation on the distribution it will be asked to draft; no prompt of benchmarks/workloads/chat.jsonl,
and the second and third sets avoid its topics too), rendered with its ChatML template, plus (2) documentation
and source of installed Python packages. New prompts help, rephrasings do not: held-out depth-1 accuracy
0.409 with 505 prompts answered twice, 0.455 with 1,480 prompts (docs/benchmarks.md).
Weights go to /work/scratch_heads (never committed).

    python benchmarks/train_smollm2_head.py --steps 400 [--method eagle3] [--answers 80] [--variants 1] [--more-answers 540] [--third-answers 435]

Needs the fp32 SmolLM2 artifact (`speccompile export smollm2-135m --out /tmp/smol`) for fast answer
generation. Prints the training summary (time, tokens) as JSON at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

STORY_SUBJECTS = ["a lighthouse on a stormy night", "a fox who collects buttons", "a boy who can hear trees", "a robot chef", "an old map",
  "a train that runs on moonlight", "a baker who never sleeps", "a turtle racing a hare again", "a forgotten toy", "a whale who sings off-key",
  "a garden that grows books", "a lonely astronaut", "a magical umbrella", "a squirrel planning a heist", "a dragon afraid of the dark",
  "a girl who builds a boat", "a town where it always rains", "an owl who teaches math", "a time-travelling teapot", "a penguin in the desert",
  "a knight who loves flowers", "a mountain that moves", "a cloud that wants to be a river", "a street musician", "a secret door in a school",
  "a grandmother's recipe box", "a detective cat", "a festival of lanterns", "a bear who opens a bakery", "a ship in a bottle"]
STORY_FORMS = ["Write a short story about {}.", "Tell me a story about {}.", "Write a poem about {}.", "Write a children's story about {}.",
  "Write a short fairy tale about {}.", "Describe {} in vivid detail."]
EXPLAIN = ["how airplanes fly", "how the heart pumps blood", "what gravity is", "how batteries store energy", "why leaves change color in autumn",
  "how a compass works", "what DNA is", "how the moon causes tides", "how solar panels work", "what inflation means in economics",
  "how volcanoes erupt", "what black holes are", "how plants drink water", "how the stock market works", "what a computer program is",
  "how clouds form", "why the ocean is salty", "how a car engine works", "what electricity is", "how our eyes see colors",
  "how bread rises", "what the immune system does", "how email gets delivered", "what a database is", "how magnets work",
  "why we dream", "how bridges stay up", "what climate change is", "how birds migrate", "how a bill becomes a law",
  "what machine learning is", "how recycling works", "why we need sleep", "how GPS finds your location", "what an ecosystem is",
  "how the printing press changed the world", "what causes thunder", "how coffee is made", "what a function is in programming", "how muscles grow"]
EXPLAIN_FORMS = ["Explain {} in simple terms.", "Can you explain {}?", "Explain {} to a child.", "Briefly explain {}."]
ADVICE = ["saving money", "learning to cook", "making new friends in a new city", "keeping a houseplant alive", "writing a good essay",
  "reducing stress at work", "learning to play the guitar", "staying motivated to exercise", "organizing a small apartment", "public speaking",
  "eating more vegetables", "traveling on a budget", "starting a vegetable garden", "learning to code", "being more productive in the morning",
  "taking better photos with a phone", "training a puppy", "drinking more water", "reading more books", "managing time as a student",
  "preparing for a long flight", "talking to a shy child", "choosing a laptop", "writing a resume", "staying safe while hiking"]
ADVICE_FORMS = ["Give me some tips for {}.", "What is the best way to get better at {}?", "What advice would you give someone about {}?"]
LISTS = ["fun things to do on a rainy day", "easy dinner recipes", "famous scientists and what they discovered", "ways to be kind to others",
  "animals that live in the rainforest", "classic novels everyone should read", "inventions that changed history", "tips for a long road trip",
  "ways to reduce plastic waste", "board games for families", "fruits that are high in vitamin C", "reasons to learn a second language",
  "things to see in Paris", "skills every adult should have", "ways to relax after work", "ideas for a school science project",
  "benefits of walking every day", "questions to ask on a first day at a new job", "ways to save energy at home", "snacks for a picnic"]
LIST_FORMS = ["List some {}.", "Give me a list of {}.", "What are five {}?"]
MISC = ["Write a thank-you note to a teacher.", "Write an email inviting friends to a picnic.", "Write a short speech for a friend's wedding.",
  "Write a product description for a reusable water bottle.", "Write a letter to your future self.", "Write a short review of a favourite movie.",
  "Compare living in a city with living in the countryside.", "What are the advantages and disadvantages of working from home?",
  "Compare trains and planes for travelling between cities.", "What is the difference between a virus and a bacterium?",
  "Write a Python function that counts the vowels in a string.", "Write a Python function that returns the largest number in a list.",
  "Write a Python function that checks whether a word is a palindrome.", "How do I sort a list of dictionaries in Python?",
  "Tell me about the history of the Roman Empire.", "Tell me about the life of Marie Curie.", "Tell me about the Great Wall of China.",
  "Describe a sunrise over the mountains.", "Describe your ideal weekend.", "Describe a cozy winter evening at home.",
  "Plan a three-day trip to Rome.", "Plan a healthy weekly meal schedule.", "Help me write a birthday message for my mother.",
  "Summarize the story of Romeo and Juliet.", "Summarize the benefits of meditation.", "What makes a good leader?",
  "Why is reading important for children?", "What is the meaning of friendship?", "How do I change a flat tire?", "How do I make a paper airplane?"]

# A second, disjoint set of prompt families (new subjects, new kinds of request) for more varied
# self-distillation data: `--more-answers N` answers the first N of them. Topics of the chat workload
# (benchmarks/workloads/chat.jsonl) are avoided, not only its exact prompts.
MORE_STORY_SUBJECTS = ["a clockmaker's apprentice", "a snowman who wants to see summer", "a library that opens at midnight",
  "a mouse who becomes a sailor", "two rival ice-cream trucks", "a pirate who is afraid of water", "a kite that escapes",
  "a giant who is very small", "a village of talking scarecrows", "a hedgehog who wants a hug", "a painter who loses her colors",
  "a mailman on the moon", "a frog prince who likes being a frog", "a lost balloon", "a circus without animals",
  "a boy and his grandfather fishing", "a haunted bicycle", "a cat who runs a hotel", "the last leaf on a tree",
  "a queen who cannot make decisions", "a dog who guards a museum", "an inventor whose inventions all fail",
  "a spaceship made of cardboard", "a river that flows uphill", "a shy firefly", "a wizard who forgets spells",
  "a family of ants moving house", "a snail who wants to be fast", "a mirror that tells the truth", "a detective parrot",
  "a soccer team of grandmothers", "a shoemaker and a mysterious customer", "a city under the sea", "a tiny door in a tree",
  "a chess piece that comes alive", "a farmer who grows clouds", "an elephant who never forgets a joke",
  "a scientist who shrinks herself", "a music box with a secret", "a monster under the bed who is scared of kids"]
MORE_STORY_FORMS = ["Write a short story about {}.", "Write a poem about {}.", "Tell a funny story about {}.",
  "Write the opening paragraph of a novel about {}."]
MORE_EXPLAIN = ["how a refrigerator keeps food cold", "what an atom is", "how earthquakes happen", "how a rainbow forms",
  "how antibiotics work", "what a budget is", "how wind turbines make electricity", "why the sky is blue",
  "how a microwave oven heats food", "what the water cycle is", "how bees make honey", "what interest on a loan is",
  "how a telescope works", "how the brain stores memories", "what a calorie is", "how an airplane stays balanced",
  "how cheese is made", "what taxes are used for", "how a submarine dives", "what an eclipse is",
  "how fingerprints are unique", "what carbon dioxide does in the atmosphere", "how a thermometer works",
  "what a password manager does", "how wifi sends data", "what a noun and a verb are", "how fish breathe underwater",
  "what the speed of light is", "how a camera takes a picture", "what a democracy is", "how glass is made",
  "what a food chain is", "how a bicycle gear works", "what an algorithm is", "how tea is grown",
  "why cats purr", "how an elevator works", "what a fossil is", "how soap removes dirt", "what a spreadsheet is used for",
  "how hurricanes form", "what a credit score is", "how chocolate is made", "why the moon has phases",
  "how a 3D printer works", "what an operating system does", "how trees grow taller", "what a vitamin is",
  "how a lock and key work", "what encryption is"]
MORE_EXPLAIN_FORMS = ["Explain {} in simple terms.", "How does this work: {}?", "Write a short paragraph explaining {}."]
MORE_ADVICE = ["learning a new language as an adult", "cooking rice perfectly", "writing a cover letter", "dealing with a noisy neighbour",
  "painting a room", "buying a used car", "keeping a journal", "teaching a child to ride a bike", "planning a wedding on a budget",
  "starting a small business", "caring for an aquarium", "giving a good presentation", "packing for a move", "negotiating a salary",
  "making a long-distance friendship last", "cleaning a kitchen quickly", "learning to swim", "choosing a good book",
  "baking cookies", "waking up early", "taking care of a new kitten", "building a birdhouse", "staying warm in winter",
  "being a good listener", "writing a short story", "growing herbs on a windowsill", "fixing a leaky tap", "learning to draw",
  "keeping a car in good condition", "hosting a dinner party"]
MORE_ADVICE_FORMS = ["How do I get started with {}?", "Share some practical tips on {}.", "What mistakes should I avoid when {}?"]
MORE_LISTS = ["ways to use leftover bread", "indoor games for kids", "famous paintings and their artists", "ways to make a small room look bigger",
  "questions to ask a doctor", "habits of successful people", "facts about the planet Mars", "easy houseplants for beginners",
  "tips for writing clear emails", "ways to learn faster", "things to do in a new city", "gift ideas for a grandfather",
  "sports that can be played alone", "ways to reduce food waste", "famous bridges of the world", "things to bring to the beach",
  "words that describe happiness", "ways to celebrate a small win", "signs that a plant needs water", "classic toys from the past",
  "ways to stay cool in summer", "uses for a cardboard box", "kitchen tools every cook needs", "musical instruments from around the world",
  "ways to spend less time on a phone", "foods rich in protein", "ideas for a family weekend", "ancient wonders of the world",
  "reasons to visit a museum", "ways to help a friend who feels sad"]
MORE_LIST_FORMS = ["Name some {}.", "Make a short list of {}.", "Can you suggest some {}?"]
MORE_MISC = ["Write a short speech for a school graduation.", "Write a letter asking a neighbour to keep an eye on my house.",
  "Write an apology email for missing a meeting.", "Write a short advertisement for a new bakery.", "Write a haiku about rain.",
  "Write a limerick about a forgetful cat.", "Write a recipe for a simple tomato soup.", "Write a recipe for pancakes.",
  "Write a short dialogue between a customer and a waiter.", "Write instructions for making a cup of tea.",
  "Write a short biography of Albert Einstein.", "Tell me about the life of Leonardo da Vinci.", "Tell me about the Vikings.",
  "Tell me about the first moon landing.", "Tell me about the invention of the telephone.", "Tell me about the Amazon rainforest.",
  "Tell me about the history of the bicycle.", "Tell me about the Olympic Games.", "Tell me about Mount Everest.",
  "Tell me about the life of William Shakespeare.", "Compare reading books with listening to audiobooks.",
  "Compare tea and coffee.", "Compare summer and winter holidays.", "What is the difference between weather and climate?",
  "What is the difference between a lake and a sea?", "What are the pros and cons of electric cars?",
  "What are the pros and cons of social media?", "Describe a thunderstorm in the countryside.", "Describe a quiet library.",
  "Describe the smell of a bakery in the morning.", "Describe a snowy forest at dawn.", "Plan a picnic in the park for four people.",
  "Plan a study schedule for learning basic Spanish in a month.", "Plan a day trip to the mountains.",
  "Write a Python function that reverses a string.", "Write a Python function that computes the factorial of a number.",
  "Write a Python function that removes duplicates from a list.", "Write a Python function that counts words in a sentence.",
  "Write a Python class for a simple bank account.", "How do I read a text file line by line in Python?",
  "What is a dictionary in Python? Give an example.", "Write a JavaScript function that adds two numbers.",
  "What is the difference between a list and a tuple in Python?", "Write a SQL query that selects all users older than 30.",
  "Why is exercise good for the brain?", "What makes a story interesting?", "Why do people enjoy music?",
  "What is kindness?", "Why is it important to recycle?", "What should I know before adopting a rabbit?"]


# A third disjoint set (definitions, how-tos, recipes, places, people, opinions, writing and code tasks):
# `--third-answers N` answers the first N of them.
THIRD_TERMS = ["a metaphor", "gravity on other planets", "a galaxy", "a volcano", "an allergy", "a mortgage", "a haiku", "a glacier",
  "an ecosystem service", "a protein", "a symphony", "a peninsula", "a mammal", "a molecule", "an enzyme", "a constellation",
  "a rainforest canopy", "a tsunami", "a hypothesis", "a prime number", "a fraction", "a percentage", "an adjective",
  "a biography", "a museum curator", "an archaeologist", "a pharmacist", "a carpenter", "an orchestra conductor", "a veterinarian",
  "a compost heap", "a greenhouse", "a satellite", "a comet", "an asteroid", "a hurricane eye", "a coral reef", "a desert oasis",
  "a web browser", "a search engine", "a spreadsheet formula", "a variable in programming", "a loop in programming",
  "a cloud server", "a robot vacuum", "a smartwatch", "a podcast", "a documentary", "a sonnet", "a fable", "a myth",
  "a legend", "an idiom", "a proverb", "a palindrome", "a synonym", "an antonym", "a thesaurus", "a microscope", "a magnet"]
THIRD_TERM_FORMS = ["What is {}?", "Define {} and give an example."]
THIRD_HOWTO = ["tie a tie", "plant a tree", "write a haiku", "clean a laptop screen", "make a budget spreadsheet",
  "iron a shirt", "wrap a present neatly", "set up a home aquarium", "back up photos from a phone", "make a simple kite",
  "sharpen a kitchen knife", "write a formal letter", "prepare for a marathon", "brew green tea", "fold a fitted sheet",
  "make homemade lemonade", "repot a plant", "create a strong password", "organize a bookshelf", "jump-start a car",
  "make a paper boat", "meditate for five minutes", "learn to juggle", "start a podcast", "clean a bicycle chain",
  "make a scrapbook", "measure a room for new carpet", "write a poem", "plan a garden bed", "teach a dog to sit",
  "make a smoothie", "remove a coffee stain", "pack a suitcase efficiently", "write a to-do list that works", "build a campfire safely",
  "change a light bulb", "bake banana bread", "make a bird feeder", "prepare a short presentation", "set a table for dinner"]
THIRD_HOWTO_FORMS = ["How do I {}?", "Give step-by-step instructions to {}."]
THIRD_DISHES = ["vegetable soup", "a fruit salad", "scrambled eggs", "a grilled cheese sandwich", "spaghetti with tomato sauce",
  "guacamole", "a simple curry", "oatmeal cookies", "fried rice", "a green salad", "mashed potatoes", "hummus", "french toast",
  "a chocolate cake", "lentil stew", "roasted vegetables", "a tuna sandwich", "apple pie", "homemade pizza", "chicken noodle soup",
  "pancakes with berries", "a bean burrito", "a vegetable omelette", "garlic bread", "rice pudding"]
THIRD_DISH_FORMS = ["How do I make {}?", "Write a simple recipe for {}."]
THIRD_PLACES = ["Japan", "the Sahara desert", "Iceland", "the city of London", "New York City", "the Grand Canyon", "Australia",
  "the Alps", "Venice", "Kenya", "Canada", "the Arctic", "Brazil", "the Moon", "the island of Bali", "Egypt's Nile river",
  "the Netherlands", "Mexico City", "the Himalayas", "Antarctica", "Greece", "Norway's fjords", "the Great Barrier Reef",
  "the city of Barcelona", "Peru", "Scotland", "Vietnam", "the Swiss lakes", "Morocco", "New Zealand"]
THIRD_PLACE_FORMS = ["Tell me about {}.", "What should a visitor know about {}?"]
THIRD_PEOPLE = ["Isaac Newton", "Ada Lovelace", "Nelson Mandela", "Cleopatra", "Galileo Galilei", "Frida Kahlo", "Mahatma Gandhi",
  "Wolfgang Amadeus Mozart", "Charles Darwin", "Amelia Earhart", "Nikola Tesla", "Jane Austen", "Martin Luther King Jr.",
  "Vincent van Gogh", "Florence Nightingale", "Alexander the Great", "Rosalind Franklin", "Ludwig van Beethoven", "Confucius",
  "Thomas Edison", "Harriet Tubman", "Pablo Picasso", "Johannes Gutenberg", "Jane Goodall", "Winston Churchill"]
THIRD_PEOPLE_FORMS = ["Who was {}?", "Write a short biography of {}."]
THIRD_OPINIONS = ["Is it better to live in a small town or a big city?", "Should children learn to cook at school?",
  "What is the best season of the year and why?", "Is it important to learn history?", "Why do people like to travel?",
  "What makes a good teacher?", "Is it better to read the book or watch the movie?", "Why are hobbies important?",
  "What makes a house feel like a home?", "Why do people keep pets?", "What is the most useful invention of all time?",
  "Should everyone learn to play an instrument?", "What makes a good friend?", "Why is teamwork important?",
  "Is it good to have a daily routine?", "Why do people enjoy sports?", "What makes a city beautiful?",
  "Why is it important to be honest?", "What can we learn from failure?", "Why do we celebrate holidays?",
  "Is technology making life easier?", "Why is art important?", "What makes a good book?", "Why should we protect forests?",
  "What is the value of volunteering?", "Why do people collect things?", "What makes a meal special?",
  "Is it better to plan or to be spontaneous?", "Why do people tell stories?", "What makes someone brave?"]
THIRD_WRITING = ["Write a slogan for a recycling campaign.", "Write an invitation to a garden party.", "Write a short toast for a retirement party.",
  "Write a welcome message for new members of a book club.", "Write a short note to a neighbour who lent me a ladder.",
  "Write a postcard from a holiday by the sea.", "Write a description of a cozy cafe for a travel guide.",
  "Write a short motivational message for a friend starting a new job.", "Write a get-well-soon card for a classmate.",
  "Write a short announcement for a school bake sale.", "Write the rules of a simple card game.", "Write a riddle and its answer.",
  "Write a short diary entry about a day at the zoo.", "Write a tongue twister about sea shells.", "Write a short scene set on a train.",
  "Write a letter from a cat to its owner.", "Write a packing list for a ski trip.", "Write a short newsletter for a gardening club.",
  "Write a two-paragraph review of a pizza restaurant.", "Write a short fable with a moral about patience.",
  "Write a poem about a city at night.", "Write a poem about friendship.", "Write a lullaby for a baby.",
  "Write an acrostic poem for the word SPRING.", "Write a short story that begins with a knock at the door."]
THIRD_CODE = ["Write a Python function that checks whether a number is prime.", "Write a Python function that computes Fibonacci numbers.",
  "Write a Python function that merges two sorted lists.", "Write a Python function that finds the average of a list of numbers.",
  "Write a Python function that converts Celsius to Fahrenheit.", "Write a Python function that capitalizes every word in a sentence.",
  "Write a Python function that returns the second largest number in a list.", "Write a Python script that prints a multiplication table.",
  "Write a Python function that checks whether two words are anagrams.", "Write a Python function that flattens a nested list.",
  "How do I write to a file in Python?", "How do I use a for loop in Python?", "What is a lambda function in Python?",
  "How do I handle exceptions in Python?", "What is the difference between == and is in Python?", "How do I create a virtual environment in Python?",
  "Write a JavaScript function that reverses an array.", "Write a SQL query that counts orders per customer.",
  "Explain what an API is with an example.", "What is version control and why is Git useful?"]


def third_training_prompts(n: int) -> list[str]:
    """Up to n prompts from the third family set (disjoint from the other two and the chat workload)."""
    families = [(THIRD_TERMS, THIRD_TERM_FORMS), (THIRD_HOWTO, THIRD_HOWTO_FORMS), (THIRD_DISHES, THIRD_DISH_FORMS),
                (THIRD_PLACES, THIRD_PLACE_FORMS), (THIRD_PEOPLE, THIRD_PEOPLE_FORMS)]
    return _mixed_without_workload(_expand(families, THIRD_OPINIONS + THIRD_WRITING + THIRD_CODE))[:n]


def more_training_prompts(n: int) -> list[str]:
    """Up to n prompts from the second family set (disjoint from `training_prompts` and the chat workload)."""
    families = [(MORE_STORY_SUBJECTS, MORE_STORY_FORMS), (MORE_EXPLAIN, MORE_EXPLAIN_FORMS), (MORE_ADVICE, MORE_ADVICE_FORMS),
                (MORE_LISTS, MORE_LIST_FORMS)]
    return _mixed_without_workload(_expand(families, MORE_MISC))[:n]


def training_prompts(n: int) -> list[str]:
    """Up to n chat prompts (stories, explanations, advice, lists, emails, code), none from the chat workload."""
    families = [(STORY_SUBJECTS, STORY_FORMS), (EXPLAIN, EXPLAIN_FORMS), (ADVICE, ADVICE_FORMS), (LISTS, LIST_FORMS)]
    return _mixed_without_workload(_expand(families, MISC))[:n]


def _expand(families: list[tuple[list[str], list[str]]], singles: list[str]) -> list[str]:
    """Every form of each family filled in with each of its subjects, then the single prompts."""
    return [form.format(subject) for subjects, forms in families for subject in subjects for form in forms] + singles


def _mixed_without_workload(prompts: list[str]) -> list[str]:
    """Distinct prompts minus the chat workload's, mixed deterministically (sorted by hash)."""
    workload = Path(__file__).parent / "workloads" / "chat.jsonl"
    held_out = {json.loads(line)["prompt"] for line in workload.read_text().splitlines() if line.strip()}
    kept = [p for p in dict.fromkeys(prompts) if p not in held_out]
    kept.sort(key=lambda p: hashlib.sha256(p.encode()).hexdigest())  # mix the kinds, deterministically
    return kept


# Rephrasings that change the context (and so the greedy answer) of every training prompt: more of the
# target's own greedy text without writing new prompts. Variant i appends VARIANT_SUFFIXES[i].
VARIANT_SUFFIXES = [" Keep it short and simple.", " Please answer in detail.", " Use a friendly tone."]


def generate_answers(artifact: Path, prompts: list[str], out: Path, max_tokens: int, threads: int = 2, batch: int = 48) -> Path:
    """SmolLM2's greedy answers to `prompts`, batched in torch (left-padded), as ChatML jsonl lines.

    Batch 48 decodes ~3-4x more tokens/s than the batch-1 runtime on 2 cores. Near-ties may resolve
    differently from the ONNX graph; that does not matter for training data.
    """
    import torch

    from speccompile.models.decoder import build_decoder
    from speccompile.models.load import load_model
    from speccompile.tokenizer import TextTokenizer

    torch.set_num_threads(threads)
    model = load_model("smollm2-135m")
    decoder = build_decoder(model.config, model.weights)
    tok = TextTokenizer(artifact)
    eos = set(model.config.eos_token_ids)
    lines: list[str] = []
    started = time.time()
    for first in range(0, len(prompts), batch):
        rows = [tok.prompt_ids(p, True) for p in prompts[first: first + batch]]
        answers = _greedy_batch(decoder, rows, max_tokens, eos, torch)
        lines += [json.dumps({"text": tok.decode(ids + ans, skip_special_tokens=False)}) for ids, ans in zip(rows, answers)]
        print(f"answers {len(lines)}/{len(prompts)} ({time.time() - started:.0f}s)", flush=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)
    return out


def _greedy_batch(decoder, rows: list[list[int]], max_tokens: int, eos: set[int], torch) -> list[list[int]]:
    """Greedy decoding of left-padded prompts; each answer stops at (and keeps) its first eos token."""
    width = max(len(r) for r in rows)
    pads = [width - len(r) for r in rows]
    ids = torch.tensor([[0] * p + r for p, r in zip(pads, rows)])
    real = torch.tensor([[False] * p + [True] * len(r) for p, r in zip(pads, rows)])
    positions = (real.long().cumsum(-1) - 1).clamp_min(0)
    mask = torch.ones(width, width, dtype=torch.bool).tril() & real[:, None, :]
    answers: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    with torch.no_grad():
        out = decoder(ids, positions, mask, *decoder.empty_past(len(rows)))
        for _ in range(max_tokens):
            nxt = out[0][:, -1].argmax(-1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    answers[i].append(t)
                    done[i] = t in eos
            if all(done):
                break
            real = torch.cat([real, torch.ones(len(rows), 1, dtype=torch.bool)], dim=1)
            positions = positions[:, -1:] + 1
            out = decoder(nxt[:, None], positions, real[:, None, :], *out[1:])
    return answers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", default="/tmp/smol")
    ap.add_argument("--method", default="eagle3", choices=["eagle3", "eagle", "medusa"])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--answers", type=int, default=480, help="chat prompts answered by the target for self-distillation")
    ap.add_argument("--answer-tokens", type=int, default=160)
    ap.add_argument("--docs-tokens", type=int, default=60_000, help="cap on documentation/source text tokens")
    ap.add_argument("--out", default="/work/scratch_heads/smollm2_{method}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--variants", type=int, default=0, choices=range(len(VARIANT_SUFFIXES) + 1),
                    help="also answer each prompt rephrased this many ways (more self-distillation data)")
    ap.add_argument("--more-answers", type=int, default=0,
                    help="also answer this many prompts of the second family set (new subjects and kinds of request)")
    ap.add_argument("--third-answers", type=int, default=0, help="also answer this many prompts of the third family set")
    args = ap.parse_args()

    from speccompile.training.trainer import TrainOptions, train_draft

    scratch = Path("/work/scratch_heads")
    scratch.mkdir(parents=True, exist_ok=True)
    answers = scratch / f"smollm2_answers_b{args.answers}_{args.answer_tokens}.jsonl"
    if not answers.is_file():
        generate_answers(Path(args.artifact), training_prompts(args.answers), answers, args.answer_tokens, args.threads)
    answer_files = [answers]
    for i, suffix in enumerate(VARIANT_SUFFIXES[: args.variants]):
        variant = scratch / f"smollm2_answers_v{i + 1}_b{args.answers}_{args.answer_tokens}.jsonl"
        if not variant.is_file():
            prompts = [p + suffix for p in training_prompts(args.answers)]
            generate_answers(Path(args.artifact), prompts, variant, args.answer_tokens, args.threads)
        answer_files.append(variant)
    for tag, prompts_of, n in (("m", more_training_prompts, args.more_answers), ("t", third_training_prompts, args.third_answers)):
        if n:
            extra = scratch / f"smollm2_answers_{tag}{n}_{args.answer_tokens}.jsonl"
            if not extra.is_file():
                generate_answers(Path(args.artifact), prompts_of(n), extra, args.answer_tokens, args.threads)
            answer_files.append(extra)
    # documentation + source of installed packages (real text on this machine)
    import click
    import jinja2

    docs = scratch / "docs_text.jsonl"
    if not docs.is_file():
        lines = []
        for pkg in (click, jinja2):
            for f in sorted(Path(pkg.__file__).parent.rglob("*.py")):
                lines.append(json.dumps({"text": f.read_text(errors="ignore")}))
        docs.write_text("\n".join(lines) + "\n")
    out = Path(args.out.format(method=args.method))
    # answers first (the workload's distribution), then docs/source up to the token cap
    n_answer_tokens = ((1 + args.variants) * args.answers + args.more_answers + args.third_answers) * (args.answer_tokens + 40)
    options = TrainOptions(method=args.method, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=1e-3,
                           warmup=min(30, args.steps // 10 + 1), max_tokens=n_answer_tokens + args.docs_tokens,
                           save_every=50, resume=args.resume, threads=args.threads)
    summary = train_draft("smollm2-135m", [*answer_files, docs], out, options, progress=lambda m: print(m, flush=True))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
