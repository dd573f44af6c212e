// Who acts: every action that changes something asks for the operator's name, and the
// console remembers the last one given in this browser, for every form alike.
import { useState } from 'react'

const KEY = 'spillway.actor'

/** The operator's name as a form field, prefilled with the last one used; `remember` keeps
 * it once the action is sent. */
export function useActor(): { actor: string; setActor: (v: string) => void; remember: () => void } {
  const [actor, setActor] = useState(() => localStorage.getItem(KEY) ?? '')
  return { actor, setActor, remember: () => localStorage.setItem(KEY, actor.trim()) }
}
