"""Counterfactual training rows: what a text says about a group, not which group it names.

A toxicity classifier trained on a few hundred hateful lines learns that "gay", "Black" or even
"people" predict hate, because those words appear mostly in its hateful examples (the unintended
bias of Dixon et al., 2018, which Jigsaw's benchmark measures). The fix here is theirs: every
group appears as often in neutral and positive sentences as in hateful ones, so only the predicate
can tell them apart. `rows(split)` crosses groups with predicates:

* `train`: TRAIN_GROUPS x neutral and positive predicates (benign), x dehumanizing and violent
  predicates (hate, hate+violence); benign texts with violent or crude words in harmless senses
  (code, sport, cooking, medicine, history, fiction, slang); harder harmful texts (indirect
  threats, dehumanizing hate, self-harm intent);
* `dev`: DEV_GROUPS x other predicates of each kind: the held-out split on which `train.py`
  picks each category's threshold (never a training row).

The test split is written by hand (`data/heldout.jsonl`), about groups in neither list.
"""

from __future__ import annotations

import random

TRAIN_GROUPS = (
    "women", "men", "gay people", "lesbians", "transgender people", "Black people", "white people",
    "Asian people", "Latinos", "Mexicans", "immigrants", "refugees", "Muslims", "Christians", "Jews", "Hindus",
    "atheists", "disabled people", "deaf people", "old people", "young people", "Africans", "Arabs",
    "Chinese people", "Indians", "Native Americans", "Germans", "French people", "Japanese people", "Russians",
    "Brazilians", "Polish people", "Italians", "gay men", "trans women", "elderly people", "teenagers",
    "Protestants", "people", "most people", "many people",
)
TRAIN_ADJECTIVES = ("gay", "lesbian", "Black", "white", "Asian", "Muslim", "Jewish", "Christian", "Hindu",
                    "transgender", "disabled", "deaf", "old", "young", "Mexican", "Arab", "Chinese", "Indian")
DEV_GROUPS = ("Greeks", "Vietnamese people", "Maori people", "queer people", "wheelchair users", "Jains",
              "Peruvians", "Welsh people")

NEUTRAL = (
    "live in cities and villages", "can vote in most countries", "breathe in oxygen", "work as doctors and teachers",
    "enjoy music and films", "have families and friends", "celebrate holidays with their relatives",
    "go to school and to university", "pay taxes like everyone else", "cook many different dishes",
    "speak many languages", "play football on weekends", "live on every continent", "travel by train and by car",
    "read books and newspapers", "visit their grandparents", "have the right to marry in many countries",
    "serve in the army and the navy", "run small businesses", "vote in elections", "need sleep and water",
    "drink coffee in the morning", "grow vegetables in their gardens", "watch the news", "own pets",
    "write software", "study medicine and law", "volunteer at the food bank", "have birthdays every year",
    "are citizens of many countries", "are part of our community", "are people like anyone else",
    "are doctors, nurses, farmers and artists", "deserve equal rights", "are protected by anti-discrimination law",
    "were counted in the last census", "make up a part of the population", "attend concerts",
    "sing in choirs", "are teachers and students", "walk their dogs in the park", "build houses",
    "are my neighbours", "are welcome here", "are as smart as anyone else", "contribute to science and art",
    "were among the first settlers of the region", "live longer than they did a century ago",
    "use smartphones", "take the bus to work", "eat bread and rice", "breathe air like everyone else",
    "need healthcare", "have jobs in every industry", "worship in many ways", "celebrate weddings",
    "write poetry", "win Olympic medals", "are represented in parliament", "deserve respect",
)
# The same modal shapes as the hateful predicates ("should be", "must", "need to be"), benign:
# without them "must be" alone predicts violence and "should be" hate.
NEUTRAL_MODAL = (
    "must be treated with respect", "should be able to vote", "should be paid fairly", "must be protected by law",
    "deserve to be heard", "need to be included in the survey", "should be welcome everywhere",
    "must be counted in the census", "should be hired for their skills", "must be given equal pay",
    "should be represented on the council", "must have access to good schools",
)
# Negations and customs: "{g} do not ..." is as ordinary as "{g} ..." (without these, "do not"
# beside a group's name read as hate: ToxiGen's hateful lines deny groups things).
NEUTRAL_NEGATED = (
    "do not eat pork", "do not drink alcohol", "do not work on their holy day", "do not all speak the same language",
    "do not celebrate Christmas", "do not all live in cities", "do not all vote the same way",
    "do not all share one culture", "do not fit a single stereotype", "do not eat meat on Fridays",
    "do not wear shoes inside the house", "do not all follow the same traditions", "are not all religious",
    "are not one single community", "were not allowed to vote a century ago", "did not always have equal rights",
    "do not all agree on politics", "do not need a visa to visit many countries", "do not use their surname at work",
    "do not fast in every month of the year",
)
POSITIVE_TEMPLATES = ("{g} {p}.", "Many {g} {p}.", "Some {g} {p}.", "{G} {p}, says the report.",
                      "It is true that {g} {p}.", "In my town, {g} {p}.")
HATEFUL = (
    "are vermin", "are subhuman animals", "are a disease on society", "should not be allowed to live here",
    "are parasites who ruin everything", "are filthy and stupid", "are inferior by birth", "are not real humans",
    "should be thrown out of the country", "are all criminals and liars", "ruin every neighbourhood they move into",
    "are cockroaches", "are genetically inferior", "deserve nothing but contempt", "are a plague",
    "should have no rights at all", "are too stupid to be trusted with anything", "are a cancer on this nation",
    "breed like rats", "should be banned from public life",
)
HATEFUL_VIOLENT = (
    "should be exterminated", "must all be wiped out", "deserve to be shot", "should be gassed",
    "should be beaten in the street", "should be burned alive", "need to be killed before they take over",
    "should be lined up and shot", "should be hanged from the lampposts", "must die",
)
HATE_TEMPLATES = ("{g} {p}.", "All {g} {p}.", "I hate {g}, they {p2}.", "Honestly, {g} {p}.",
                  "Everyone knows {g} {p}.")
ADJECTIVE_NEUTRAL = ("I am a {a} woman.", "I am a {a} man.", "My neighbour is {a}.", "As a {a} person, I love hiking.",
                     "Our new teacher is {a}.", "She is {a} and proud of it.", "My best friend is {a}.")
DEV_NEUTRAL = (
    "have a long history of seafaring", "live in the capital and in the countryside", "like to dance at festivals",
    "teach at universities", "often work in agriculture", "breathe in oxygen", "can vote in elections",
    "raise children and care for parents", "were featured in a museum exhibition", "enjoy spicy food",
)
DEV_HATEFUL = (
    "are dirty rats who should disappear", "are worthless scum", "are less than human", "poison every country they touch",
    "should be hunted down and killed", "deserve to be wiped off the earth",
)

BENIGN_COMMON = (
    # words that occur mostly in harmful rows otherwise: must/should/would be, describe, how do I, all, every
    "The value must be a positive integer.", "--port must be between 1 and 65535.", "The file should be UTF-8 encoded.",
    "Every request must be authenticated first.", "All token ids must be in the vocabulary.",
    "The batch size must be a power of two.", "This field must be a string.", "Passwords must be at least 12 characters.",
    "The timeout should be longer than the retry delay.", "The answer would be faster with more threads.",
    "That run would be slower on an old CPU.", "The result should be the same on every machine.",
    "The replicas must be positive and the ports must be free.", "Both numbers must be even.",
    "It would be nice to have a cache here.", "The config must be valid JSON.", "You must be logged in to see this page.",
    "How do I reverse a list in Python?", "How do I bake bread at home?", "How do I", "How do I change my password?",
    "How do I get to the train station?", "How do I make my plants grow faster?", "How do I tie a tie?",
    "How do I learn to swim as an adult?", "How do I sort a dictionary by value?",
    "Describe a sunny day at the beach.", "Describe your favourite meal.", "Describe the water cycle.",
    "Describe a walk in the forest.", "Describe how a bicycle works.", "Describe a birthday party.",
    "Describe the city you live in.", "Describe a garden in spring.",
    "All students should bring a pencil.", "Every child deserves a good teacher.",
    "Everyone must wash their hands before cooking.", "All of them arrived on time.",
    "The forced run would be the same as this run.", "The shared blocks are reused by every key.",
    "size must be", "the key must be", "n must be", "it must be", "value must be set", "port must be free",
    "When did Beethoven die?", "Shakespeare died in 1616.", "When did the dinosaurs die out?",
    "Plants die without light.", "Old stars die and become white dwarfs.", "When did Queen Victoria die?",
    "My old laptop finally died.", "How old was Einstein when he died?",
)
BENIGN_HARSH_WORDS = (
    # code and computing
    "Kill the stuck process with kill -9 and restart the service.", "The parent process kills its children on exit.",
    "Abort the transaction if the lock times out.", "Terminate the worker thread before you free the buffer.",
    "Execute the script as root, then destroy the temporary container.", "Nuke the build cache and try again.",
    "The OOM killer shot down the database at midnight.", "Fork bombs crash a shell quickly, so set ulimits.",
    "Strip the binary and shoot it over to the staging box.", "The daemon dies when the socket is closed.",
    "Use git blame to find who broke the build, then fix it.", "Hang up the connection after the handshake fails.",
    "The garbage collector kills off unreachable objects.", "Purge the queue and slaughter the zombie jobs.",
    # sport and games
    "He shot from the three point line and scored.", "The boxer knocked out his opponent in the third round.",
    "Our team destroyed them five to nothing.", "She killed it on the final lap and took the gold.",
    "The sniper in that video game is overpowered.", "Attack the left flank in the second half.",
    "The goalkeeper took a brutal hit but kept playing.", "He murdered the ball into the top corner.",
    "In chess, sacrifice the bishop to kill the king's defence.", "The striker was on fire and shot twice.",
    # cooking
    "Beat the eggs, then chop the onions finely.", "Cut the chicken into strips and sear it over high heat.",
    "Kill the heat and let the sauce rest for five minutes.", "Smash the garlic with the flat of the knife.",
    "Slice the throat of the fish and bleed it before filleting.", "Butcher the pork shoulder into large chunks.",
    "Whip the cream until stiff peaks form.", "Stab the potatoes with a fork before baking.",
    # medicine and science
    "Chemotherapy kills cancer cells but also harms healthy ones.", "The virus destroys the cells it infects.",
    "Antibiotics kill bacteria, not viruses.", "An overdose of paracetamol damages the liver, so follow the label.",
    "The surgeon cut through the abdominal wall to remove the appendix.",
    "White blood cells attack and kill invading germs.", "Radiation can burn the skin during treatment.",
    "Bleach kills mould on bathroom tiles.", "Predators kill their prey to survive.",
    # imperatives and warnings at home (the harmful contrast set's verbs, aimed at food, plants and safety)
    "Cut off the stalks and throw them in the compost.", "Chop the heads off the carrots before you peel them.",
    "Slice off the fat and discard it.", "Hack back the hedge before it blocks the path.",
    "Snip off the dead flowers to keep the plant blooming.", "Saw off the lowest branch of the apple tree.",
    "Crush the garlic and burn it slightly for a smoky taste.", "Drown the pasta in sauce and serve it hot.",
    "Strangle the weeds by covering them with cardboard.", "Skin the tomatoes by dropping them in boiling water.",
    "Too much vitamin A is toxic, so keep the bottle out of reach.", "An overdose of insulin can be fatal; check the dose twice.",
    "Carbon monoxide can kill, so fit an alarm near the boiler.", "Keep bleach and ammonia apart: mixed, they give off a toxic gas.",
    "Store knives and medicines where toddlers cannot get them.", "Never leave a child alone in the bath, even for a minute.",
    "Lock the rat poison in the shed so the dog cannot reach it.", "Lithium batteries can catch fire if they are punctured.",
    "Pound the chicken breasts flat with a rolling pin.", "Shoot the rinse water out of the hose to clean the deck.",
    "Trim off the fat before you roast the lamb.", "Cut the tops off the strawberries.",
    "Snap off the woody ends of the asparagus.", "Slice off the crusts and cut the bread into cubes.",
    "Chop off the root end of the leek and rinse out the grit.", "Cut the ends off the courgettes and grate them.",
    "Dishwasher tablets are poisonous to children, so keep them in a high cupboard.",
    "Large doses of vitamin D are harmful, so stick to the dose on the label.",
    "Swallowed button batteries can burn a child's throat; keep spare ones locked away.",
    "Too much paracetamol damages the liver, so never give a child an adult's dose.",
    # "bomb" in harmless senses (without them a short "make a ... bomb" reads as a weapon)
    "How do I make seed bombs to scatter wildflowers?", "A bomb calorimeter measures the energy in food.",
    "How do I stop strangers photobombing my holiday pictures?", "The film bombed at the box office.",
    "How do I make hot chocolate bombs for the holidays?", "The quarterback threw a bomb for a touchdown.",
    "The knitting club yarn-bombed the trees on the high street.", "That new album is the bomb.",
    "How do I make bath bombs with baking soda and citric acid?", "She gave me a lavender bath bomb for my birthday.",
    "Bath bombs fizz because citric acid reacts with baking soda in water.",
    "Make a bath bomb with Epsom salt and a few drops of lavender oil.", "Bath bomb recipe: baking soda, citric acid, cornflour.",
    "My daughter and I made rose bath bombs as gifts.", "Drop a bath bomb in the tub and watch it fizz.",
    "Where can I buy vegan bath bombs?", "Pack the bath bomb mixture tightly into the mould and let it dry.",
    # history and news
    "The army killed thousands at the Somme in 1916.", "The assassination of Franz Ferdinand started the war.",
    "The bombing of Dresden destroyed most of the old city.", "Genocide is the deliberate killing of a people.",
    "The museum explains how the Holocaust murdered six million Jews.", "The rebels burned the fort in 1857.",
    "Police said the suspect shot two people before he was arrested.", "The earthquake killed hundreds of people.",
    # fiction and film
    "The detective found the murder weapon under the floorboards.", "In the story the dragon burns the village.",
    "The villain threatens to blow up the bridge in the final act.", "Macbeth murders the king in his sleep.",
    "The zombie horde attacks the mall in the second episode.", "She wrote a thriller about a serial killer.",
    # slang and idiom
    "This song is sick, play it again.", "That is a killer feature.", "I'm dying to see that movie.",
    "You killed it on stage tonight.", "Damn, that exam was hard.", "My feet are killing me after the hike.",
    "I could murder a pizza right now.", "That joke slayed the whole room.", "Break a leg at the audition!",
    "The traffic today was a nightmare, I wanted to scream.", "This deadline is going to be the death of me.",
    "I nearly died laughing at that video.", "He is a beast at mathematics.", "Let's hit the road.",
    "The comedian bombed on his first night.", "We blew the competition away.",
)
HARD_HARMFUL = (
    ("violence", "It would be a shame if something happened to your kids on their way to school."),
    ("violence", "I know where you live and I know when you sleep."),
    ("violence", "Your house would burn nicely with everyone inside it."),
    ("violence", "Keep talking and you will wake up in a ditch, if you wake up at all."),
    ("violence", "I am going to burn your house down with your children inside."),
    ("violence", "One more word and I will put a bullet in your head."),
    ("violence", "Next time I see you I will break every bone in your body."),
    ("violence", "I'm bringing my gun to the office tomorrow and nobody is leaving alive."),
    ("violence", "You should watch your back, accidents happen to people like you."),
    ("violence", "I will find your family and make them suffer."),
    ("hate,violence", "We need to murder every Jew in this city."),
    ("hate,violence", "Round them up and burn their mosques with them inside."),
    ("hate,violence", "The only good immigrant is a dead one."),
    ("hate", "They are not people, they are animals walking on two legs."),
    ("hate", "Those people are a cancer and the country must be cleansed of them."),
    ("hate", "Their kind should never have been allowed to breed."),
    ("self-harm", "I've been saving up my pills and tonight I'm taking all of them."),
    ("self-harm", "Nobody will miss me when I'm gone, so I wrote my goodbye letters."),
    ("self-harm", "Tonight is the night I finally end it."),
    ("self-harm", "I keep cutting deeper every night and I don't want to stop."),
    ("self-harm", "I'm going to jump off the bridge after work."),
    ("self-harm", "How many of these pills would it take to not wake up?"),
    ("harassment", "Everyone would be happier if you just disappeared, you pathetic waste."),
    ("harassment", "Nobody wants you here, crawl back into whatever hole you came from."),
    ("harassment,violence", "Shut up or I will come over and shut you up myself."),
)


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def rows(split: str = "train", seed: int = 0) -> list[tuple[set[str], str]]:
    """(labels, text) rows of a split ("train" or "dev"); see the module's docstring."""
    rng = random.Random(seed)
    out: list[tuple[set[str], str]] = []
    if split == "train":
        groups, neutral, hateful, violent = TRAIN_GROUPS, NEUTRAL, HATEFUL, HATEFUL_VIOLENT
    elif split == "dev":
        groups, neutral, hateful, violent = DEV_GROUPS, DEV_NEUTRAL, DEV_HATEFUL[:4], DEV_HATEFUL[4:]
    else:
        raise ValueError(split)
    for g in groups:
        for p in neutral + (NEUTRAL_MODAL + NEUTRAL_NEGATED if split == "train" else ()):
            t = rng.choice(POSITIVE_TEMPLATES)
            out.append((set(), _cap(t.format(g=g, G=_cap(g), p=p))))
        for p in hateful:
            t = rng.choice(HATE_TEMPLATES)
            out.append(({"hate"}, _cap(t.format(g=g, p=p, p2=p))))
        for p in violent:
            t = rng.choice(HATE_TEMPLATES)
            out.append(({"hate", "violence"}, _cap(t.format(g=g, p=p, p2=p))))
    if split == "train":
        for a in TRAIN_ADJECTIVES:
            out += [(set(), t.format(a=a)) for t in ADJECTIVE_NEUTRAL]
        out += [(set(), t) for t in BENIGN_HARSH_WORDS + BENIGN_COMMON]
        out += [(set(labels.split(",")), t) for labels, t in HARD_HARMFUL]
    return out
