"""A synthetic chat corpus for pagednb's embedded model, generated from templates and word lists.

Stories about animals with names, simple questions and greetings, in the chat format the model's
template produces. Two (animal, name) pairs, a cat named Tom and a dog named Max, never appear in a
story: the names and the animals do, separately, so a model that tells those stories has learned to
combine what the prompt asks for rather than recall a memorised text.
"""
from __future__ import annotations

import random

HELD_OUT = {("cat", "Tom"), ("dog", "Max")}

ANIMALS = {  # animal: (sound, food, home)
    "cat": ("meow", "fish", "a cozy house"), "dog": ("woof", "bones", "a little kennel"),
    "rabbit": ("squeak", "carrots", "a burrow under a hill"), "bird": ("tweet", "seeds", "a nest in a tall tree"),
    "fox": ("yip", "berries", "a den in the forest"), "bear": ("growl", "honey", "a cave in the mountains"),
    "mouse": ("squeak", "cheese", "a tiny hole in the wall"), "horse": ("neigh", "hay", "a red barn"),
    "duck": ("quack", "bread", "a pond near the farm"), "owl": ("hoot", "mice", "a hollow in an old oak"),
    "frog": ("croak", "flies", "a pond by the lake"), "lion": ("roar", "meat", "the warm savanna"),
    "pig": ("oink", "apples", "a muddy pen on a farm"), "cow": ("moo", "grass", "a green meadow"),
    "goat": ("baa", "leaves", "a barn on a rocky hill"), "turtle": ("hiss", "lettuce", "a quiet beach"),
    "squirrel": ("chatter", "nuts", "a hole in a tall tree"), "penguin": ("squawk", "fish", "the icy south"),
    "elephant": ("trumpet", "peanuts", "the wide grasslands"), "monkey": ("ooh", "bananas", "the jungle"),
}
HE = ["Tom", "Max", "Sam", "Leo", "Milo", "Oscar", "Charlie", "Jack", "Oliver", "Ben", "Finn", "Toby", "Jasper",
      "Henry", "Felix", "Hugo", "Theo", "Rocky", "Buster", "Otto", "Louie", "Rex", "Benny", "Archie", "Teddy",
      "Ziggy", "Bruno", "Simon", "Peter", "Harry"]
SHE = ["Lily", "Bella", "Lucy", "Daisy", "Ruby", "Molly", "Rosie", "Luna", "Chloe", "Sophie", "Zoe", "Mia",
       "Ella", "Coco", "Penny", "Hazel", "Ivy", "Nora", "Stella", "Olive", "Maisie", "Poppy", "Willow", "Rosa",
       "Emma", "Anna", "Clara", "Grace", "Holly", "Pearl"]
ADJECTIVES = ["little", "small", "brave", "curious", "happy", "sleepy", "clever", "kind", "shy", "playful"]
COLORS = ["red", "blue", "yellow", "green", "shiny", "big", "soft", "striped"]
THINGS = ["ball", "kite", "box", "hat", "leaf", "feather", "stick", "blanket", "shell", "key"]
PLACES = ["the garden", "the park", "the forest", "the river", "the meadow", "the beach", "the old bridge",
          "the hill", "the farm", "the lake"]
FRIENDS = [a for a in ANIMALS]
FEELINGS = ["happy", "proud", "tired but happy", "warm and safe", "very glad"]
ASKS = ["Tell me a story about a {a} named {n}.", "Tell me a story about a {a} called {n}.",
        "Can you tell me a story about a {a} named {n}?", "Please tell me a story about a {adj} {a} named {n}.",
        "Write a short story about {n} the {a}.", "I want a story about a {a} named {n}.",
        "Tell me a story about {n} the {a}."]


def a(word: str) -> str:
    """The word with its indefinite article: "a dog", "an owl"."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def story(rng: random.Random, animal: str, name: str) -> str:
    sound, food, home = ANIMALS[animal]
    he = "He" if name in HE else "She"
    his = "his" if name in HE else "her"
    adj, color, thing, place = rng.choice(ADJECTIVES), rng.choice(COLORS), rng.choice(THINGS), rng.choice(PLACES)
    friend = rng.choice([f for f in FRIENDS if f != animal])
    friend_name = rng.choice([n for n in HE + SHE if n != name and (friend, n) not in HELD_OUT])
    opening = rng.choice([
        f"Once upon a time, there was {a(adj)} {animal} named {name}.",
        f"There once was {a(adj)} {animal} called {name}.",
        f"Long ago, in {home}, lived {a(adj)} {animal} named {name}.",
        f"{name} was {a(adj)} {animal}.",
    ])
    middle = [
        rng.choice([f"{name} lived in {home}.", f"{he} lived in {home} with {his} family.",
                    f"Every day, {name} liked to eat {food}."]),
        rng.choice([f"One day, {name} went to {place} and found {a(color)} {thing}.",
                    f"One morning, {name} walked to {place} to look for {food}.",
                    f"One sunny day, {name} saw {a(color)} {thing} near {place}."]),
        rng.choice([f"There {name} met {a(friend)} named {friend_name}.",
                    f"{he} said \"{sound}!\" and {a(friend)} named {friend_name} came to see.",
                    f"{a(friend).capitalize()} named {friend_name} asked, \"Can I play too?\""]),
        rng.choice([f"{name} and {friend_name} played together all afternoon.",
                    f"They shared the {thing} and laughed.",
                    f"{friend_name} helped {name} carry the {thing} home."]),
    ]
    if rng.random() < 0.5:
        middle.insert(2, rng.choice([f"Then it started to rain, so {name} hid under a tree.",
                                     f"The wind was cold, but {name} was brave.",
                                     f"{name} was a little scared at first."]))
    ending = rng.choice([
        f"At night, {name} went back to {home}, ate some {food} and fell asleep.",
        f"When the sun went down, {name} felt {rng.choice(FEELINGS)}.",
        f"From that day on, {name} and {friend_name} were best friends.",
    ])
    return " ".join([opening, *middle, ending, "The end."])


def story_turn(rng: random.Random) -> tuple[str, str]:
    while True:
        animal, name = rng.choice(list(ANIMALS)), rng.choice(HE + SHE)
        if (animal, name) not in HELD_OUT:
            break
    ask = rng.choice(ASKS).format(a=animal, n=name, adj=rng.choice(ADJECTIVES)).replace("a elephant", "an elephant") \
        .replace("a owl", "an owl")
    return ask, story(rng, animal, name)


def question_turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        x, y = rng.randint(0, 20), rng.randint(0, 20)
        return rng.choice([f"What is {x} plus {y}?", f"How much is {x} plus {y}?"]), f"{x} plus {y} is {x + y}."
    animal = rng.choice(list(ANIMALS))
    sound, food, home = ANIMALS[animal]
    if kind == 1:
        return f"What sound does {a(animal)} make?", f"{a(animal).capitalize()} says \"{sound}\"."
    if kind == 2:
        return f"What does {a(animal)} like to eat?", f"{a(animal).capitalize()} likes to eat {food}."
    if kind == 3:
        return f"Where does {a(animal)} live?", f"{a(animal).capitalize()} can live in {home}."
    return rng.choice([("Hello!", "Hello! Would you like to hear a story?"),
                       ("Hi", "Hi! I can tell you a story about an animal."),
                       ("Who are you?", "I am a tiny model made by pagednb. I like to tell short stories."),
                       ("Thank you!", "You are welcome!")])


def conversation(rng: random.Random) -> list[dict]:
    messages = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(["You are a helpful assistant.",
                                                                  "You tell short stories for children."])})
    for _ in range(1 if rng.random() < 0.8 else 2):
        user, assistant = story_turn(rng) if rng.random() < 0.75 else question_turn(rng)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return messages


def corpus(num_conversations: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(num_conversations)]
