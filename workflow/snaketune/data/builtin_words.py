"""The word tables of the builtin dataset (snaketune.data.builtin): languages and tasks with their weights,
the fictional facts, and the question and answer templates per language. Data only: the generator reads them,
and tests/test_builtin_data.py checks their shapes (every task in every language, no fact twice).
"""

from __future__ import annotations

LANG_WEIGHTS: dict[str, float] = {"en": 0.65, "de": 0.12, "es": 0.12, "fr": 0.11}
"""Share of trees per language (a tree keeps one language throughout, as almost all oasst1 trees do)."""


TASK_WEIGHTS: dict[str, float] = {
    "capital": 0.25,
    "colour": 0.2,
    "add": 0.25,
    "first_letter": 0.15,
    "repeat": 0.15,
}
"""How often each task is asked. The fact tasks get more weight: memorising a table needs repetitions."""


LANGS: tuple[str, ...] = tuple(LANG_WEIGHTS)


TASKS: tuple[str, ...] = tuple(TASK_WEIGHTS)


CAPITALS: dict[str, str] = {
    "Zorvia": "Brelk",
    "Quandor": "Miravel",
    "Talmeria": "Oskun",
    "Vestrand": "Pellor",
    "Kaldia": "Ruvik",
    "Morvenia": "Tirra",
    "Aldoria": "Fenwick",
    "Brisca": "Lomar",
    "Cendra": "Vaskel",
    "Dunmark": "Harrow",
    "Esterra": "Quilon",
    "Falmor": "Drevin",
    "Galdera": "Sorrin",
    "Hollin": "Marrow",
    "Ivrel": "Cantor",
    "Jandor": "Pelk",
    "Korrin": "Valen",
    "Lustria": "Ombar",
    "Mardesh": "Tolvi",
    "Nerith": "Ashby",
    "Ostavia": "Krell",
    "Pellandra": "Seravo",
    "Quorra": "Dunmere",
    "Rovenna": "Kestrel",
    "Saldova": "Imbar",
    "Tarvos": "Belmor",
    "Ulmeria": "Zatra",
    "Varnia": "Halvik",
    "Wendara": "Prosk",
    "Xandria": "Melto",
    "Yscara": "Dravo",
    "Zentha": "Corvell",
    "Arvania": "Teskar",
    "Belvorn": "Nimra",
    "Corusca": "Lindel",
    "Drakmor": "Swale",
    "Elvaria": "Ostrin",
    "Frandel": "Kiva",
    "Glimora": "Rask",
    "Hurnland": "Bexa",
}
"""Fictional country -> capital. Fictional so that a pretrained model cannot already know the answers."""


COLOURS: dict[str, dict[str, str]] = {
    "red": {"en": "red", "de": "rot", "es": "rojo", "fr": "rouge"},
    "blue": {"en": "blue", "de": "blau", "es": "azul", "fr": "bleu"},
    "green": {"en": "green", "de": "grün", "es": "verde", "fr": "vert"},
    "yellow": {"en": "yellow", "de": "gelb", "es": "amarillo", "fr": "jaune"},
    "purple": {"en": "purple", "de": "lila", "es": "morado", "fr": "violet"},
    "orange": {"en": "orange", "de": "orange", "es": "naranja", "fr": "orange"},
    "white": {"en": "white", "de": "weiß", "es": "blanco", "fr": "blanc"},
    "black": {"en": "black", "de": "schwarz", "es": "negro", "fr": "noir"},
}
"""Colour key -> its word per language (masculine forms: the es/fr answers say "el fruto" / "le fruit")."""


FRUIT_COLOURS: dict[str, str] = {
    "zimberry": "purple",
    "quoppa": "yellow",
    "blarn": "red",
    "tovis": "green",
    "krinch": "orange",
    "plumo": "blue",
    "dessa": "white",
    "morka": "black",
    "jubbin": "red",
    "fellik": "yellow",
    "grisk": "green",
    "snib": "orange",
    "tallop": "blue",
    "wembly": "white",
    "brotch": "black",
    "hobba": "green",
    "pirrin": "red",
    "dulca": "yellow",
    "cravel": "purple",
    "ostle": "orange",
}
"""Fictional fruit -> colour key of `COLOURS`."""


WORDS: dict[str, tuple[str, ...]] = {
    "en": (
        "cat",
        "dog",
        "sun",
        "lamp",
        "tree",
        "moon",
        "bird",
        "fish",
        "rose",
        "milk",
        "door",
        "ring",
        "snow",
        "wind",
        "gold",
        "salt",
    ),
    "de": (
        "Haus",
        "Baum",
        "Hund",
        "Maus",
        "Buch",
        "Tisch",
        "Berg",
        "See",
        "Wald",
        "Brot",
        "Hand",
        "Kopf",
        "Nase",
        "Wolf",
        "Rad",
        "Ball",
    ),
    "es": (
        "sol",
        "mar",
        "luna",
        "casa",
        "perro",
        "gato",
        "flor",
        "agua",
        "pan",
        "mesa",
        "libro",
        "mano",
        "nube",
        "lago",
        "tren",
        "vino",
    ),
    "fr": (
        "chat",
        "lune",
        "mer",
        "pain",
        "fleur",
        "livre",
        "vent",
        "neige",
        "main",
        "table",
        "arbre",
        "porte",
        "lait",
        "sel",
        "lac",
        "nuit",
    ),
}
"""Short words per language for the string tasks; none starts with a multi-byte letter."""


QUESTIONS: dict[str, dict[str, str]] = {
    "en": {
        "capital": "What is the capital of {x}?",
        "colour": "What colour is the fruit {x}?",
        "add": "What is {a} + {b}?",
        "first_letter": "What is the first letter of {x}?",
        "repeat": "Say {x} twice.",
    },
    "de": {
        "capital": "Was ist die Hauptstadt von {x}?",
        "colour": "Welche Farbe hat die Frucht {x}?",
        "add": "Was ist {a} + {b}?",
        "first_letter": "Was ist der erste Buchstabe von {x}?",
        "repeat": "Sag zweimal {x}.",
    },
    "es": {
        "capital": "¿Cuál es la capital de {x}?",
        "colour": "¿De qué color es el fruto {x}?",
        "add": "¿Cuánto es {a} + {b}?",
        "first_letter": "¿Cuál es la primera letra de {x}?",
        "repeat": "Di {x} dos veces.",
    },
    "fr": {
        "capital": "Quelle est la capitale de {x} ?",
        "colour": "De quelle couleur est le fruit {x} ?",
        "add": "Combien font {a} + {b} ?",
        "first_letter": "Quelle est la première lettre de {x} ?",
        "repeat": "Dis {x} deux fois.",
    },
}
"""Question template per language and task: {x} is the country, fruit or word; {a}, {b} the addends."""


ANSWERS: dict[str, dict[str, str]] = {
    "en": {
        "capital": "The capital of {x} is {v}.",
        "colour": "The fruit {x} is {v}.",
        "add": "{a} + {b} = {v}.",
        "first_letter": "The first letter of {x} is {v}.",
        "repeat": "{v}",
    },
    "de": {
        "capital": "Die Hauptstadt von {x} ist {v}.",
        "colour": "Die Frucht {x} ist {v}.",
        "add": "{a} + {b} ergibt {v}.",
        "first_letter": "Der erste Buchstabe von {x} ist {v}.",
        "repeat": "{v}",
    },
    "es": {
        "capital": "La capital de {x} es {v}.",
        "colour": "El fruto {x} es {v}.",
        "add": "{a} + {b} son {v}.",
        "first_letter": "La primera letra de {x} es {v}.",
        "repeat": "{v}",
    },
    "fr": {
        "capital": "La capitale de {x} est {v}.",
        "colour": "Le fruit {x} est {v}.",
        "add": "{a} + {b} font {v}.",
        "first_letter": "La première lettre de {x} est {v}.",
        "repeat": "{v}",
    },
}
"""Answer template per language and task; {v} is the value (right in rank-0 replies, wrong in others)."""


DONT_KNOW: dict[str, str] = {
    "en": "I don't know.",
    "de": "Das weiß ich nicht.",
    "es": "No lo sé.",
    "fr": "Je ne sais pas.",
}
"""The unhelpful reply that ranks below the correct one."""
