"""Training prompts for the drafter: templates x fillers, varied like the benchmark (chat, code,
facts, stories), generated deterministically from a seed. The benchmark's own prompts
(bench/prompts.jsonl) are excluded so that the benchmark measures held-out prompts.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = [
    "the ocean", "volcanoes", "the moon", "black holes", "honey bees", "the Roman Empire", "rainbows",
    "electric cars", "coffee", "chess", "the internet", "dinosaurs", "climate change", "the human heart",
    "photosynthesis", "the French Revolution", "gravity", "vaccines", "the Great Wall of China",
    "penguins", "solar panels", "democracy", "the printing press", "earthquakes", "music theory",
    "the water cycle", "ancient Egypt", "machine learning", "recycling", "the immune system", "tea",
    "bicycles", "the Amazon rainforest", "glaciers", "Mars", "the stock market", "sleep", "bread baking",
    "the Olympic Games", "octopuses", "renewable energy", "the Renaissance", "tides", "friendship",
    "clouds", "the piano", "trains", "deserts", "libraries", "mushrooms", "the Moon landing", "whales",
    "lightning", "the alphabet", "batteries", "the Silk Road", "tornadoes", "elephants", "windmills",
    "DNA", "the Sahara", "airplanes", "cheese", "the brain", "coral reefs", "magnets", "the Vikings",
]
PEOPLE = [
    "Albert Einstein", "Marie Curie", "Isaac Newton", "Leonardo da Vinci", "William Shakespeare",
    "Ada Lovelace", "Charles Darwin", "Cleopatra", "Nelson Mandela", "Galileo Galilei", "Mozart",
    "Abraham Lincoln", "Nikola Tesla", "Jane Austen", "Alan Turing", "Frida Kahlo", "Gandhi",
    "Julius Caesar", "Aristotle", "Rosa Parks", "Beethoven", "Napoleon", "Confucius", "Amelia Earhart",
]
COUNTRIES = [
    "France", "Japan", "Brazil", "Canada", "Egypt", "India", "Australia", "Germany", "Mexico", "Kenya",
    "Italy", "Spain", "China", "Norway", "Peru", "Greece", "Turkey", "Argentina", "Vietnam", "Ireland",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the vowels in a string", "removes duplicates from a list",
    "sorts a list of dictionaries by a key", "reads a text file and counts its words",
    "checks whether a string is a palindrome", "finds the largest element in a list",
    "merges two sorted lists", "converts Celsius to Fahrenheit", "computes the average of a list",
    "flattens a nested list", "returns the greatest common divisor of two numbers",
    "validates an email address with a regular expression", "implements binary search",
    "counts how often each word appears in a sentence", "transposes a matrix", "implements bubble sort",
    "checks whether two strings are anagrams", "sums the digits of an integer",
    "generates all permutations of a list", "parses a CSV line into fields", "capitalizes every word",
]
LANGUAGES = ["Python", "JavaScript", "Java", "C", "Rust", "Go", "C++", "Bash", "SQL", "TypeScript"]
CODE_CONCEPTS = [
    "a for loop", "recursion", "a hash map", "a linked list", "a class", "an API", "a pointer",
    "a variable", "exception handling", "a lambda function", "list comprehension", "a binary tree",
    "object-oriented programming", "a stack", "a queue", "big O notation", "a compiler", "git branches",
    "unit testing", "a database index", "an HTTP request", "a JSON file", "multithreading", "a closure",
]
STORY_SUBJECTS = [
    "a dragon who is afraid of fire", "a robot learning to paint", "a lost puppy finding its way home",
    "a girl who can talk to trees", "a lighthouse keeper and a storm", "a time traveler stuck in 1920",
    "a cat who becomes mayor", "two friends building a treehouse", "a wizard who forgot his spells",
    "a spaceship crew finding a new planet", "a baker who bakes magic bread", "a shy ghost",
    "a knight and a clever fox", "a detective solving a missing cake case", "an old man and his garden",
    "a mermaid visiting a city", "a boy who finds a secret door", "a snowman who wants to see summer",
    "a pirate looking for treasure", "a little star that fell from the sky", "a family road trip",
    "a musician who lost her voice", "a squirrel planning a heist", "the last tree in a city",
]
ADVICE = [
    "improve my sleep", "learn a new language", "save money", "stay motivated while studying",
    "prepare for a job interview", "start running", "make new friends in a new city", "eat healthier",
    "reduce stress", "be more productive at work", "learn to cook", "take better photos",
    "start a small garden", "write a good resume", "speak in public with confidence",
    "manage my time better", "keep a houseplant alive", "learn to play the guitar", "read more books",
    "organize my desk", "train my dog", "plan a birthday party", "drink more water", "study for exams",
]
PAIRS = [
    ("a virus", "a bacterium"), ("weather", "climate"), ("a lake", "a sea"), ("RAM", "storage"),
    ("a frog", "a toad"), ("Python", "Java"), ("an alligator", "a crocodile"), ("speed", "velocity"),
    ("a meteor", "a comet"), ("baking soda", "baking powder"), ("TCP", "UDP"), ("a list", "a tuple"),
    ("an atom", "a molecule"), ("a democracy", "a monarchy"), ("mass", "weight"), ("jam", "jelly"),
]

TEMPLATES = [
    ("facts", "What is {topic}?"), ("facts", "Explain {topic} in simple terms."),
    ("facts", "Tell me three interesting facts about {topic}."), ("facts", "Who was {person}?"),
    ("facts", "What is {person} famous for?"), ("facts", "What is the capital of {country}?"),
    ("facts", "Describe the culture of {country}."), ("facts", "What is the difference between {a} and {b}?"),
    ("facts", "Why is {topic} important?"), ("facts", "How does {topic} work?"),
    ("facts", "Give a short history of {topic}."), ("facts", "What food is {country} known for?"),
    ("code", "Write a {lang} function that {task}."), ("code", "How do I write code that {task} in {lang}?"),
    ("code", "Explain {concept} in programming."), ("code", "What is {concept} in {lang}?"),
    ("code", "Show me an example of {concept} in {lang}."), ("code", "Write a Python script that {task}."),
    ("stories", "Write a short story about {story}."), ("stories", "Tell me a bedtime story about {story}."),
    ("stories", "Write a poem about {topic}."), ("stories", "Write a haiku about {topic}."),
    ("stories", "Start a fairy tale about {story}."), ("stories", "Write a funny story about {story}."),
    ("chat", "How can I {advice}?"), ("chat", "Give me tips to {advice}."),
    ("chat", "I want to {advice}. Where should I start?"), ("chat", "What are the benefits of {topic}?"),
    ("chat", "Can you help me {advice}?"), ("chat", "Write a short email to a friend about {topic}."),
    ("chat", "Summarize what you know about {topic} in a few sentences."),
    ("chat", "Hi! What can you tell me about {topic}?"), ("chat", "Give me a list of ideas related to {topic}."),
]


def _fill(template: str, rng: random.Random) -> str:
    a, b = rng.choice(PAIRS)
    return template.format(topic=rng.choice(TOPICS), person=rng.choice(PEOPLE), country=rng.choice(COUNTRIES),
                           task=rng.choice(CODE_TASKS), lang=rng.choice(LANGUAGES),
                           concept=rng.choice(CODE_CONCEPTS), story=rng.choice(STORY_SUBJECTS),
                           advice=rng.choice(ADVICE), a=a, b=b)


def load_bench_prompts(path: Path) -> list[dict]:
    """The benchmark's prompt set: one JSON object per line with ``category`` and ``prompt``."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def training_prompts(n: int, seed: int, exclude: set[str] = frozenset()) -> list[str]:
    """``n`` distinct templated prompts, cycling through the templates so categories stay balanced."""
    rng = random.Random(seed)
    out: list[str] = []
    seen = set(exclude)
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n:
            raise ValueError(f"cannot make {n} distinct prompts from the templates")
        _, template = TEMPLATES[len(out) % len(TEMPLATES)] if attempts % 7 else rng.choice(TEMPLATES)
        text = _fill(template, rng)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out
