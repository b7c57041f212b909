"""Writes the two tiny local evaluation sets (mc.jsonl, qa.jsonl) used by docs/evaluation.md."""
import json
import pathlib

here = pathlib.Path(__file__).parent
MC = [  # (question, [4 choices], index of the right one)
 ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
 ("The capital of Germany is", ["Vienna", "Berlin", "Prague", "Oslo"], 1),
 ("The capital of Italy is", ["Milan", "Naples", "Rome", "Turin"], 2),
 ("The capital of Spain is", ["Lisbon", "Barcelona", "Seville", "Madrid"], 3),
 ("The capital of Japan is", ["Tokyo", "Osaka", "Kyoto", "Seoul"], 0),
 ("The capital of the United Kingdom is", ["Dublin", "London", "Paris", "Edinburgh"], 1),
 ("The capital of Russia is", ["Kiev", "Minsk", "Moscow", "Warsaw"], 2),
 ("The capital of China is", ["Shanghai", "Hong Kong", "Taipei", "Beijing"], 3),
 ("The capital of Egypt is", ["Cairo", "Alexandria", "Tunis", "Rabat"], 0),
 ("The capital of Canada is", ["Toronto", "Ottawa", "Vancouver", "Montreal"], 1),
 ("The largest planet in the solar system is", ["Jupiter", "Mars", "Venus", "Mercury"], 0),
 ("The planet closest to the Sun is", ["Earth", "Mercury", "Neptune", "Saturn"], 1),
 ("The Red Planet is", ["Venus", "Jupiter", "Mars", "Uranus"], 2),
 ("Water freezes at a temperature of", ["50 degrees Celsius", "100 degrees Celsius", "20 degrees Celsius", "0 degrees Celsius"], 3),
 ("Water boils at sea level at", ["100 degrees Celsius", "10 degrees Celsius", "0 degrees Celsius", "500 degrees Celsius"], 0),
 ("The chemical symbol for water is", ["CO2", "H2O", "NaCl", "O3"], 1),
 ("The chemical symbol for gold is", ["Ag", "Fe", "Au", "Cu"], 2),
 ("The gas that plants take in from the air is", ["oxygen", "helium", "neon", "carbon dioxide"], 3),
 ("The number of days in a week is", ["seven", "five", "ten", "twelve"], 0),
 ("The number of months in a year is", ["ten", "twelve", "eight", "twenty"], 1),
 ("The number of legs a spider has is", ["six", "four", "eight", "ten"], 2),
 ("The number of continents on Earth is", ["three", "four", "five", "seven"], 3),
 ("Two plus two equals", ["four", "five", "six", "three"], 0),
 ("Ten minus three equals", ["six", "seven", "eight", "nine"], 1),
 ("Five times two equals", ["eight", "twelve", "ten", "seven"], 2),
 ("Nine divided by three equals", ["nine", "six", "one", "three"], 3),
 ("The opposite of hot is", ["cold", "warm", "red", "fast"], 0),
 ("The opposite of up is", ["left", "down", "over", "high"], 1),
 ("The opposite of day is", ["morning", "sun", "night", "light"], 2),
 ("The opposite of big is", ["large", "huge", "tall", "small"], 3),
 ("A baby cat is called a", ["kitten", "puppy", "calf", "foal"], 0),
 ("A baby dog is called a", ["kitten", "puppy", "lamb", "chick"], 1),
 ("The animal known as the king of the jungle is the", ["mouse", "rabbit", "lion", "snail"], 2),
 ("The largest ocean on Earth is the", ["Atlantic Ocean", "Indian Ocean", "Arctic Ocean", "Pacific Ocean"], 3),
 ("The longest river in Africa is the", ["Nile", "Thames", "Seine", "Danube"], 0),
 ("The tallest mountain in the world is", ["Mont Blanc", "Mount Everest", "Kilimanjaro", "Mount Fuji"], 1),
 ("The author of Romeo and Juliet is", ["Charles Dickens", "Mark Twain", "William Shakespeare", "Jane Austen"], 2),
 ("The color of the sky on a clear day is", ["green", "red", "yellow", "blue"], 3),
 ("The color of grass is", ["green", "purple", "orange", "black"], 0),
 ("Bees make", ["milk", "honey", "silk", "wool"], 1),
 ("Cows give us", ["honey", "eggs", "milk", "wool"], 2),
 ("The Sun rises in the", ["west", "north", "south", "east"], 3),
 ("The first month of the year is", ["January", "March", "June", "December"], 0),
 ("The last month of the year is", ["January", "December", "July", "April"], 1),
 ("The day after Monday is", ["Sunday", "Friday", "Tuesday", "Thursday"], 2),
 ("The language spoken in Brazil is", ["Spanish", "French", "English", "Portuguese"], 3),
 ("The currency of the United States is the", ["dollar", "euro", "yen", "pound"], 0),
 ("The currency of Japan is the", ["dollar", "yen", "peso", "rupee"], 1),
 ("The organ that pumps blood through the body is the", ["liver", "lung", "heart", "stomach"], 2),
 ("People breathe with their", ["ears", "hands", "feet", "lungs"], 3),
]
QA = [  # (question, answer)
 ("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
 ("What is the capital of Italy?", "Rome"), ("What is the capital of Germany?", "Berlin"),
 ("What is the capital of Spain?", "Madrid"), ("What is the capital of England?", "London"),
 ("What is the capital of Russia?", "Moscow"), ("What is the capital of Egypt?", "Cairo"),
 ("What is two plus two?", "4"), ("What is three plus four?", "7"),
 ("What is ten minus five?", "5"), ("What is two times three?", "6"),
 ("What color is the sky?", "Blue"), ("What color is grass?", "Green"),
 ("What color is snow?", "White"), ("What is the largest planet?", "Jupiter"),
 ("What do bees make?", "Honey"), ("What is the opposite of hot?", "Cold"),
 ("What is the first month of the year?", "January"), ("How many days are in a week?", "7"),
]
with open(here / "mc.jsonl", "w") as f:
    f.writelines(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in MC)
with open(here / "qa.jsonl", "w") as f:
    f.writelines(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QA)
print(len(MC), len(QA))
